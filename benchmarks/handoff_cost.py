"""Forwarded over local /step latency with connection handoff off (the hop) and on.

Two 4-worker servers side by side, ``--handoff off`` and ``--handoff on``,
each with one counter session per worker, stepped by two kinds of client:

- **kept-alive**: one connection for a run of steps. *local*: a connection
  the holder accepted. *forwarded*: a connection another worker accepted
  (opened afresh for each round, untimed, until it lands there): with the hop
  every step crosses the private socket; with handoff the first step moves
  the connection to the holder and the rest are served there.
- **new connection per request**: connect, one step, close (``http.client``
  with HTTP/1.1 keep-alive semantics, as most HTTP clients without a pool).
  Which worker accepted the connection is read from ``/proc`` (untimed,
  between connect and request), and the step goes to the session that worker
  holds (*local*) or one another worker holds (*forwarded*: hopped, or the
  connection handed over); the reply's debug headers confirm the class.
  Connect time is included.

The classes run in interleaved rounds (`routing_cost.interleaved_rounds`), and
ratios are the median of per-round ratios (the machine is shared and noisy).
Every reply's count is checked.

    .venv/bin/python benchmarks/handoff_cost.py [--rounds 30] [--batch 60]

Prints Markdown tables; writes handoff_cost.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import itertools
import json
import socket
import time
from typing import Any

import _common
from _common import RawConnection, markdown_table, worker_deliveries
from routing_cost import WORKERS, SessionFleet, interleaved_rounds

from gym_sessions.server.process import ServerProcess, start_server

TARGET = "envs.counter:CounterEnv"
MODES = ("off", "on")
KINDS = ("kept-alive", "new connection")


def label(mode: str, kind: str, where: str) -> str:
    return f"handoff {mode}, {kind}, {where}"


class Fleet(SessionFleet):
    """A `SessionFleet` also stepped from connections another worker accepted."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(server)
        host, port = server.url.split("://", 1)[1].rsplit(":", 1)
        self.address = (host, int(port))
        self.by_pid = {_common.worker_pid(w): w for w in self.workers}

    def kept_forwarded(self, r: int, n: int, into: list[float]) -> None:
        owner = self.holder(r)
        for _ in range(400):
            via = RawConnection(self.server.url)  # untimed: until another worker accepts
            if via.worker != owner:
                break
            via.close()
        try:
            self.sessions[owner].steps(via, n, into)
        finally:
            via.close()

    def new_connection(self, r: int, n: int, into: list[float], *, local: bool) -> None:
        """``n`` steps, each on a new connection: of the session its acceptor holds, or not."""
        for i in range(n):
            action = 1 if i % 2 == 0 else -1
            body = json.dumps({"action": action}).encode()
            started = time.perf_counter_ns()
            connection = http.client.HTTPConnection(*self.address, timeout=30)
            connection.connect()
            connected = time.perf_counter_ns()
            connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # Untimed: which worker accepted it (from /proc), to pick the session.
            acceptor = self._acceptor(connection.sock.getsockname()[1])
            if local:
                session = self.sessions[acceptor]
            else:
                others = [w for w in self.workers if w != acceptor]
                session = self.sessions[others[(r + i) % len(others)]]
            headers = {"Content-Type": "application/json", **session.headers}
            sent = time.perf_counter_ns()
            connection.request("POST", "/step", body=body, headers=headers)
            response = connection.getresponse()
            data = json.loads(response.read())
            into.append((connected - started + time.perf_counter_ns() - sent) / 1e6)
            connection.close()
            session.count += action
            if response.status != 200 or data["observation"] != session.count:
                raise RuntimeError(f"step went wrong: {response.status} {data}")
            moved = response.getheader("x-gym-forwarded-by") or response.getheader(
                "x-gym-handed-over-by"
            )
            if bool(moved) == local:
                raise RuntimeError(f"misclassified: local={local}, moved by {moved}")

    def _acceptor(self, client_port: int) -> str:
        for _ in range(1000):
            pid = _common.accepting_pid(self.server.process.pid, self.address[1], client_port)
            if pid in self.by_pid:
                return self.by_pid[pid]
            time.sleep(0.001)  # not accepted yet
        raise RuntimeError("no worker accepted the connection")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=60, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=120, help="unrecorded steps per class")
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()

    with contextlib.ExitStack() as stack:
        fleets: dict[str, Fleet] = {}
        for mode in MODES:
            server = stack.enter_context(
                start_server(TARGET, "--handoff", mode, "--debug-worker-header", workers=WORKERS)
            )
            fleets[mode] = Fleet(server)
            stack.callback(fleets[mode].close)

        batches: dict[str, Any] = {}
        for mode in MODES:
            fleet = fleets[mode]
            batches[label(mode, "kept-alive", "local")] = fleet.local
            batches[label(mode, "kept-alive", "forwarded")] = fleet.kept_forwarded
            batches[label(mode, "new connection", "local")] = functools.partial(
                fleet.new_connection, local=True
            )
            batches[label(mode, "new connection", "forwarded")] = functools.partial(
                fleet.new_connection, local=False
            )
        per_round = interleaved_rounds(
            batches, cycle=WORKERS, warmup=args.warmup, rounds=args.rounds, batch=args.batch
        )
        counts = {mode: worker_deliveries(fleets[mode].server.url, WORKERS) for mode in MODES}

    report = summarize(per_round, args, machine, counts)
    print_report(report)
    path = _common.write_json("handoff_cost", report)
    print(f"\nwrote {path}")


def summarize(
    per_round: dict[str, list[list[float]]],
    args: argparse.Namespace,
    machine: dict[str, Any],
    counts: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    p50s = {k: [_common.percentile(b, 50) for b in v] for k, v in per_round.items()}
    p99s = {k: [_common.percentile(b, 99) for b in v] for k, v in per_round.items()}
    ratios: dict[str, float] = {}
    for mode, kind in itertools.product(MODES, KINDS):
        local, forwarded = label(mode, kind, "local"), label(mode, kind, "forwarded")
        if local not in per_round or forwarded not in per_round:
            continue
        for q, table in (("p50", p50s), ("p99", p99s)):
            ratios[f"{mode}|{kind}|{q}"] = _common.median_ratio(table[forwarded], table[local])
    pooled = {k: _common.summary([x for b in v for x in b]) for k, v in per_round.items()}
    return {
        "machine": machine,
        "rounds": args.rounds,
        "batch": args.batch,
        "unit": "ms per request, client-side wall time of one /step",
        "pooled": pooled,
        "per_round_p50": p50s,
        "per_round_p99": p99s,
        "ratios_median_of_rounds": ratios,
        "deliveries": counts,
        "targets": {"forwarded_over_local_p50": 1.3, "forwarded_over_local_p99": 1.5},
    }


def print_report(report: dict[str, Any]) -> None:
    print(
        f"\n/step latency; {report['rounds']} interleaved rounds x {report['batch']} steps per "
        f"class ({report['machine']['nproc']} cpus)\n"
    )
    rows = [
        [kind, s["n"], f"{s['p50']:.3f}", f"{s['p90']:.3f}", f"{s['p99']:.3f}"]
        for kind, s in report["pooled"].items()
    ]
    print(markdown_table(["class", "requests", "p50 ms", "p90 ms", "p99 ms"], rows))
    print()
    ratio_rows = []
    for key, value in report["ratios_median_of_rounds"].items():
        mode, kind, q = key.split("|")
        target = "<= 1.3" if q == "p50" else "<= 1.5"
        ratio_rows.append(
            [f"handoff {mode}, {kind}: forwarded / local, {q}", f"{value:.3f}", target]
        )
    print(markdown_table(["median of per-round ratios", "value", "target"], ratio_rows))
    print()
    for mode, workers in report["deliveries"].items():
        handed = sum(w["handed_over"] for w in workers.values())
        hopped = sum(w["hopped"] for w in workers.values())
        print(f"handoff {mode}: {handed} requests handed over, {hopped} hopped (/health)")


if __name__ == "__main__":
    main()
