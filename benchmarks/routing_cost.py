"""Latency of one tool call (counter ``/step``) served locally vs forwarded to another worker.

Sequential steps over ONE kept-alive connection at a time (``http.client``,
TCP_NODELAY), against a 1-worker server and 4-worker routed servers running
side by side (one per ``--forward-transport`` the CLI offers, default first).
On each 4-worker server the script opens kept-alive connections until every
worker accepted two (``GET /health`` on a connection names the worker that
accepted it; health is never forwarded), starts one session per worker on that
worker's first connection, and then steps each session

- over the worker's second connection: **local** (the accepting worker holds
  the session: one in-memory claim lookup, no hop), or
- over a connection accepted by another worker: **forwarded** (the accepting
  worker reads the claim file and forwards over the owner's private socket).

A diagnostic class sends the step straight to the owner's private Unix socket
(served there, as a forwarded request is on arrival). The classes run in
interleaved rounds (a batch of each per round, the order rotating, the owner
and the forwarding worker rotating), and ratios are the median of per-round
ratios, since the machine is shared and noisy: each forwarded class over local,
over the 1-worker server and over the default transport's forwarded class, and
each hop's cost (forwarded - local, p50) over the aiohttp hop's. Every claim is checked against
the claim file and every reply's count against the expected count.

    .venv/bin/python benchmarks/routing_cost.py [--rounds 40] [--batch 100]

Prints Markdown tables; writes routing_cost.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import _common
from _common import RawConnection, connections_by_worker, markdown_table, session_cookie

from gym_sessions.server.process import ServerProcess, start_server
from tests.services import claim_owner

TARGET = "envs.counter:CounterEnv"
WORKERS = 4
SINGLE = "1-worker server"
LOCAL = "4 workers, local"
PRIVATE = "private socket direct"


def forwarded_label(transport: str | None) -> str:
    return "4 workers, forwarded" + (f" ({transport})" if transport else "")


class SteppedSession:
    """A counter session and the count its steps should reach."""

    def __init__(self, start_on: RawConnection) -> None:
        self.session_id = uuid.uuid4().hex
        status, reply, response = start_on.request(
            "POST", "/reset", {"resources_session_id": self.session_id}
        )
        if status != 200:
            raise RuntimeError(f"reset failed: {status} {reply}")
        cookie = session_cookie(response)
        if cookie is None:
            raise RuntimeError("the reset set no session cookie")
        self.headers = {"Cookie": f"{_common.COOKIE}={cookie}"}
        self.count = 0
        self.owner = start_on.worker

    def steps(self, connection: RawConnection, n: int, into: list[float]) -> None:
        """``n`` sequential steps over ``connection``; appends each latency (ms) to ``into``."""
        for i in range(n):
            action = 1 if i % 2 == 0 else -1
            started = time.perf_counter_ns()
            status, reply, _ = connection.request("POST", "/step", {"action": action}, self.headers)
            into.append((time.perf_counter_ns() - started) / 1e6)
            self.count += action
            if status != 200 or reply["observation"] != self.count:
                raise RuntimeError(f"step went wrong: {status} {reply}, expected {self.count}")


class SessionFleet:
    """Connections to a 4-worker server grouped by accepting worker, one session per worker.

    Round ``r`` steps the session `holder` names for it: the workers take turns.
    """

    def __init__(self, server: ServerProcess) -> None:
        self.server = server
        self.groups = connections_by_worker(server.url, workers=WORKERS, per_worker=2)
        self.workers = sorted(self.groups)
        self.sessions = {w: SteppedSession(self.groups[w][0]) for w in self.workers}

    def holder(self, r: int) -> str:
        return self.workers[r % len(self.workers)]

    def local(self, r: int, n: int, into: list[float]) -> None:
        owner = self.holder(r)
        self.sessions[owner].steps(self.groups[owner][1], n, into)

    def close(self) -> None:
        for connection in itertools.chain(*self.groups.values()):
            connection.close()


class Fleet(SessionFleet):
    """A `SessionFleet` that also reaches each worker over its private socket (file claims)."""

    def __init__(self, server: ServerProcess) -> None:
        super().__init__(server)
        self.private: dict[str, RawConnection] = {}
        runtime = _common.runtime_dir(server)
        for worker, session in self.sessions.items():
            on_file = claim_owner(runtime, session.session_id)
            if on_file != worker:
                raise RuntimeError(f"claim of a session started on {worker} names {on_file}")
            socket_path = os.path.join(runtime, "workers", f"{worker}.sock")
            self.private[worker] = RawConnection(server.url, unix_socket=socket_path)
            if self.private[worker].worker != worker:
                raise RuntimeError("a private socket answered for another worker")

    def forwarded(self, r: int, n: int, into: list[float]) -> None:
        owner = self.holder(r)
        shift = 1 + (r // len(self.workers)) % (len(self.workers) - 1)
        via = self.groups[self.workers[(r + shift) % len(self.workers)]][0]
        assert via.worker != owner
        self.sessions[owner].steps(via, n, into)

    def direct(self, r: int, n: int, into: list[float]) -> None:
        owner = self.holder(r)
        self.sessions[owner].steps(self.private[owner], n, into)

    def check(self) -> None:
        """Every connection must still be the one that learned its worker."""
        _common.check_connections(self.groups)

    def close(self) -> None:
        super().close()
        for connection in self.private.values():
            connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=200, help="unrecorded steps per class")
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()  # before the run: its load average is the one at the start
    transports = _common.forward_transports()

    with contextlib.ExitStack() as stack:
        one = stack.enter_context(start_server(TARGET, workers=1))
        fours = {
            t: stack.enter_context(
                start_server(TARGET, *_common.transport_args(t), workers=WORKERS)
            )
            for t in transports
        }
        single = RawConnection(one.url)
        stack.callback(single.close)
        single_session = SteppedSession(single)
        fleets = {}
        for t, server in fours.items():
            fleets[t] = Fleet(server)
            stack.callback(fleets[t].close)
        default = fleets[transports[0]]

        batches = {
            SINGLE: lambda r, n, into: single_session.steps(single, n, into),
            LOCAL: default.local,
            **{forwarded_label(t): fleet.forwarded for t, fleet in fleets.items()},
            PRIVATE: default.direct,
        }
        per_round = interleaved_rounds(
            batches, cycle=WORKERS, warmup=args.warmup, rounds=args.rounds, batch=args.batch
        )
        for fleet in fleets.values():
            fleet.check()

    report = summarize(per_round, transports, args, machine)
    print_report(report, transports)
    path = _common.write_json("routing_cost", report)
    plot(per_round)
    print(f"\nwrote {path} and routing_cost.png")


def interleaved_rounds(
    batches: dict[str, Callable[[int, int, list[float]], Any]],
    *,
    cycle: int,
    warmup: int,
    rounds: int,
    batch: int,
) -> dict[str, list[list[float]]]:
    """Warm every class up, then time ``rounds`` rounds of ``batch`` calls in `round_order`.

    ``batches[kind](r, n, into)`` makes ``n`` calls of class ``kind`` in round
    ``r`` and appends each call's seconds to ``into``; ``cycle`` is how many
    rounds it takes a class to use all its connections once (its warm-up is
    spread over them). Returns each class's per-round samples.
    """
    classes = list(batches)
    for r, kind in itertools.product(range(cycle), classes):
        batches[kind](r, max(1, warmup // cycle), [])
    per_round: dict[str, list[list[float]]] = {kind: [] for kind in classes}
    for r in range(rounds):
        for kind in round_order(classes, r):
            samples: list[float] = []
            batches[kind](r, batch, samples)
            per_round[kind].append(samples)
    return per_round


def round_order(classes: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by one each round, reversed every other cycle.

    Every class takes every position equally often, with both neighbours.
    """
    shift = r % len(classes)
    order = classes[shift:] + classes[:shift]
    return order[::-1] if (r // len(classes)) % 2 else order


def summarize(
    per_round: dict[str, list[list[float]]],
    transports: list[str | None],
    args: argparse.Namespace,
    machine: dict,
) -> dict:
    classes = list(per_round)
    pooled = {k: _common.summary([x for b in per_round[k] for x in b]) for k in classes}
    p50s = {k: [_common.percentile(b, 50) for b in per_round[k]] for k in classes}
    p99s = {k: [_common.percentile(b, 99) for b in per_round[k]] for k in classes}
    ratios = {
        "local_over_1_worker_p50": _common.median_ratio(p50s[LOCAL], p50s[SINGLE]),
        "private_direct_over_local_p50": _common.median_ratio(p50s[PRIVATE], p50s[LOCAL]),
    }
    hop_ms = {}
    hops = {
        t: [f - lo for f, lo in zip(p50s[forwarded_label(t)], p50s[LOCAL], strict=True)]
        for t in transports
    }
    for t in transports:
        forwarded = forwarded_label(t)
        name = t or "default"
        ratios[f"forwarded_{name}_over_local_p50"] = _common.median_ratio(
            p50s[forwarded], p50s[LOCAL]
        )
        ratios[f"forwarded_{name}_over_local_p99"] = _common.median_ratio(
            p99s[forwarded], p99s[LOCAL]
        )
        ratios[f"forwarded_{name}_over_1_worker_p50"] = _common.median_ratio(
            p50s[forwarded], p50s[SINGLE]
        )
        hop_ms[name] = statistics.median(hops[t])
        if t != transports[0]:
            ratios[f"forwarded_{name}_over_forwarded_{transports[0]}_p50"] = _common.median_ratio(
                p50s[forwarded], p50s[forwarded_label(transports[0])]
            )
        if "aiohttp" in transports and t != "aiohttp":
            ratios[f"hop_{name}_over_hop_aiohttp_p50"] = _common.median_ratio(
                hops[t], hops["aiohttp"]
            )
    return {
        "machine": machine,
        "rounds": args.rounds,
        "batch": args.batch,
        "transports": transports,
        "unit": "ms per request, client-side wall time of one sequential /step",
        "pooled": pooled,
        "per_round_p50": p50s,
        "per_round_p99": p99s,
        "ratios_median_of_rounds": ratios,
        "hop_cost_p50_ms_median_of_rounds": hop_ms,
        "targets": {
            "forwarded_over_local_p50": 1.3,
            "forwarded_over_local_p99": 1.5,
            "hop_over_hop_aiohttp_p50": 0.4,
        },
    }


def print_report(report: dict, transports: list[str | None]) -> None:
    pooled, ratios = report["pooled"], report["ratios_median_of_rounds"]
    print(
        f"\n/step latency, one kept-alive connection, sequential; {report['rounds']} interleaved "
        f"rounds x {report['batch']} steps per class ({report['machine']['nproc']} cpus)\n"
    )
    rows = [
        [kind, s["n"], f"{s['p50']:.3f}", f"{s['p90']:.3f}", f"{s['p99']:.3f}"]
        for kind, s in pooled.items()
    ]
    print(markdown_table(["class", "requests", "p50 ms", "p90 ms", "p99 ms"], rows))
    print()
    ratio_rows = []
    for t in transports:
        name = t or "default"
        hop = report["hop_cost_p50_ms_median_of_rounds"][name]
        key = f"forwarded_{name}_over_"
        ratio_rows += [
            [f"forwarded ({name}) / local, p50", ratios[key + "local_p50"], "<= 1.3"],
            [f"forwarded ({name}) / local, p99", ratios[key + "local_p99"], "<= 1.5"],
            [f"forwarded ({name}) / 1-worker, p50", ratios[key + "1_worker_p50"], ""],
            [f"hop cost ({name}): forwarded - local, p50 ms", hop, ""],
        ]
        if t != transports[0]:
            ratio_rows.append(
                [
                    f"forwarded ({name}) / forwarded ({transports[0]}), p50",
                    ratios[f"{key}forwarded_{transports[0]}_p50"],
                    "",
                ]
            )
        if f"hop_{name}_over_hop_aiohttp_p50" in ratios:
            ratio_rows.append(
                [
                    f"hop cost ({name}) / hop cost (aiohttp), p50",
                    ratios[f"hop_{name}_over_hop_aiohttp_p50"],
                    "<= 0.4",
                ]
            )
    ratio_rows += [
        ["local (4 workers) / 1-worker, p50", ratios["local_over_1_worker_p50"], ""],
        ["private socket direct / local, p50", ratios["private_direct_over_local_p50"], ""],
    ]
    ratio_rows = [[label, f"{value:.3f}", target] for label, value, target in ratio_rows]
    print(markdown_table(["median of per-round ratios", "value", "target"], ratio_rows))


def plot(per_round: dict[str, list[list[float]]]) -> None:
    _common.latency_cdf(
        "routing_cost",
        per_round,
        "One tool call: local vs forwarded (sequential, kept-alive)",
        legend_size=8,
    )


if __name__ == "__main__":
    main()
