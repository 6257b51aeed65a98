"""Many sessions on one kept-alive connection: 4 workers over 1 worker, p50 (issue 32 item 4).

The shape of a proxy's upstream pool, an agent harness's aiohttp pool or
NeMo's agents: ONE kept-alive connection (``http.client``, TCP_NODELAY)
carrying requests for ``--sessions`` counter sessions (40), stepped round
robin. Each session is started with ``/reset`` on that connection (balanced
placement spreads them over the workers) and stepped with its own cookie, so
at 4 workers about three requests in four name a session another worker than
the connection's current one holds.

Servers side by side, one connection and one set of sessions each:

- a 1-worker server (the baseline: every request local);
- a 4-worker server with the default settings (connection handoff on);
- a 4-worker server with ``--handoff off`` (every such request hops);
- more 4-worker servers with ``--variant NAME='ARGS'`` (extra serve flags);
- on the default server, a second client with 40 sessions of its own and one
  kept-alive connection per worker, each request sent on the connection its
  session's holder accepted: what a client told where each session lives (a
  hint) could reach at best;
- our own client sharing connections: 40 `AsyncRemoteEnv` sessions with one
  `ConnectionPool` (each request on its holder's connection, as the replies'
  hints say), on the 4-worker default server over the same client on the
  1-worker server (its own baseline: the Gymnasium client does more per step
  than the raw connection above).

The classes run in interleaved rounds (`routing_cost.interleaved_rounds`),
and each ratio is the median of per-round p50 ratios over the 1-worker
class (the machine is shared and noisy). Every reply's count is checked.

    .venv/bin/python benchmarks/pooled_connection.py [--rounds 30] [--batch 200] [--baseline REV]
        [--pool-only]

``--baseline REV`` adds a 4-worker server of that commit's code (default
settings), checked out in a temporary ``git worktree``, to the same rounds.

The machine's own floor, in the same rounds (``--no-floor`` leaves it out):
plain uvicorn processes serving a bare Starlette JSON route
(`bare_step_app.py`, no gym-sessions), one connection to one process against
one connection to each of ``--workers`` processes used round robin. Their
ratio is what taking turns between processes costs a sequential client here
with nothing of ours in the way.

Prints Markdown tables and each 4-worker server's ``/health`` delivery
counts; writes pooled_connection.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any, cast

import _common
from _common import RawConnection, markdown_table, worker_deliveries
from routing_cost import SteppedSession, interleaved_rounds

from gym_sessions.client import AsyncRemoteEnv, ConnectionPool
from gym_sessions.server.process import ServerProcess, start_server
from tests.services import free_port

TARGET = "envs.counter:CounterEnv"
SINGLE = "1 worker"
DIRECT = "a connection per worker, each request on its holder's"
PLAIN_ONE = "plain uvicorn, 1 process (the floor's baseline)"
PLAIN_TURNS = "plain uvicorn, a connection to each process, round robin"
POOL_ONE = "our ConnectionPool client, 1 worker"
POOL_MANY = "our ConnectionPool client (AsyncRemoteEnv sessions sharing one pool)"
#: Each ratio's denominator, where it is not the 1-worker server.
BASELINE_OF = {PLAIN_TURNS: PLAIN_ONE, POOL_MANY: POOL_ONE}
TARGET_RATIO = 1.3
HERE = os.path.dirname(os.path.abspath(__file__))


class PooledSession(SteppedSession):
    """A `SteppedSession` that knows its holder (the start reply's ``x-gym-worker``)."""

    def __init__(self, start_on: RawConnection) -> None:
        self.session_id = uuid.uuid4().hex
        status, reply, response = start_on.request(
            "POST", "/reset", {"resources_session_id": self.session_id}
        )
        cookie = _common.session_cookie(response)
        if status != 200 or cookie is None:
            raise RuntimeError(f"reset failed: {status} {reply}")
        self.headers = {"Cookie": f"{_common.COOKIE}={cookie}"}
        self.count = 0
        self.owner = response.getheader("x-gym-worker") or start_on.worker


class PooledClient:
    """One kept-alive connection and the sessions it steps round robin."""

    def __init__(self, server: ServerProcess, sessions: int) -> None:
        self.server = server
        self.connection = RawConnection(server.url)
        self.sessions = [PooledSession(self.connection) for _ in range(sessions)]
        self.next = 0

    def steps(self, r: int, n: int, into: list[float]) -> None:
        """``n`` steps, each of the next session in turn; each latency (ms) into ``into``."""
        for _ in range(n):
            session = self.sessions[self.next]
            self.next = (self.next + 1) % len(self.sessions)
            session.steps(self.connection, 1, into)

    def holders(self) -> dict[str, int]:
        """Sessions per worker, as each session's start reply named it (``x-gym-worker``)."""
        counts: dict[str, int] = {}
        for session in self.sessions:
            counts[session.owner] = counts.get(session.owner, 0) + 1
        return counts

    def close(self) -> None:
        self.connection.close()


class DirectClient(PooledClient):
    """The same sessions, each request on a connection its holder accepted.

    What a client told where each session lives (a hint) could reach at
    best: one kept-alive connection per worker (`connections_by_worker`),
    every request served where it arrives. Measured on the default server.
    """

    def __init__(self, server: ServerProcess, sessions: int, workers: int) -> None:
        super().__init__(server, sessions)
        self.groups = _common.connections_by_worker(server.url, workers=workers, per_worker=1)

    def steps(self, r: int, n: int, into: list[float]) -> None:
        for _ in range(n):
            session = self.sessions[self.next]
            self.next = (self.next + 1) % len(self.sessions)
            session.steps(self.groups[session.owner][0], 1, into)

    def close(self) -> None:
        super().close()
        for group in self.groups.values():
            for connection in group:
                connection.close()


class PoolClient:
    """``sessions`` `AsyncRemoteEnv` sessions sharing one `ConnectionPool`, stepped round robin.

    On an event loop of its own, run to completion per batch; every count checked.
    """

    def __init__(self, server: ServerProcess, sessions: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.pool = ConnectionPool(server.url)
        self.envs: list[AsyncRemoteEnv] = self.loop.run_until_complete(self._start(sessions))
        self.counts = [0] * sessions
        self.next = 0

    async def _start(self, sessions: int) -> list[AsyncRemoteEnv]:
        envs = []
        for _ in range(sessions):
            env = await AsyncRemoteEnv.create(self.pool.url, pool=self.pool)
            await env.reset()
            envs.append(env)
        return envs

    def steps(self, r: int, n: int, into: list[float]) -> None:
        self.loop.run_until_complete(self._steps(n, into))

    async def _steps(self, n: int, into: list[float]) -> None:
        for i in range(n):
            k = self.next
            self.next = (k + 1) % len(self.envs)
            action = 1 if i % 2 == 0 else -1
            started = time.perf_counter_ns()
            observation, *_ = await self.envs[k].step(action)
            into.append((time.perf_counter_ns() - started) / 1e6)
            self.counts[k] += action
            if observation != self.counts[k]:
                raise RuntimeError(f"pooled step went wrong: {observation}, not {self.counts[k]}")

    def holders(self) -> dict[str, int]:
        """Sessions per worker, as their replies named the holder."""
        counts: dict[str, int] = {}
        for env in self.envs:
            holder = str(env._http.holder)  # type: ignore[union-attr]
            counts[holder] = counts.get(holder, 0) + 1
        return counts

    def close(self) -> None:
        async def close_all() -> None:
            for env in self.envs:
                await env.close()
            await self.pool.close()

        self.loop.run_until_complete(close_all())
        self.loop.close()


@contextlib.contextmanager
def plain_processes(n: int) -> Iterator[list[str]]:
    """``n`` uvicorn processes of `bare_step_app` (a port each); their URLs, stopped at exit."""
    ports = [free_port() for _ in range(n)]
    command = [sys.executable, "-m", "uvicorn", "bare_step_app:app", "--log-level", "warning"]
    processes = [subprocess.Popen([*command, "--port", str(port)], cwd=HERE) for port in ports]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        for url in urls:
            _common.wait_for(url, timeout=30)
        yield urls
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class PlainClient:
    """Steps over kept-alive connections to plain processes, round robin (counts checked)."""

    def __init__(self, urls: list[str]) -> None:
        self.connections = [RawConnection(url) for url in urls]
        self.next = 0

    def steps(self, r: int, n: int, into: list[float]) -> None:
        for i in range(n):
            connection = self.connections[self.next]
            self.next = (self.next + 1) % len(self.connections)
            started = time.perf_counter_ns()
            status, reply, _ = connection.request("POST", "/step", {"action": i})
            into.append((time.perf_counter_ns() - started) / 1e6)
            if status != 200 or reply["observation"] != 1:
                raise RuntimeError(f"plain step went wrong: {status} {reply}")

    def close(self) -> None:
        for connection in self.connections:
            connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=400, help="unrecorded steps per class")
    parser.add_argument("--sessions", type=int, default=40, help="sessions per connection")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="another multi-worker server with these serve flags (repeatable)",
    )
    parser.add_argument("--no-defaults", action="store_true", help="only the --variant servers")
    parser.add_argument(
        "--pool-only",
        action="store_true",
        help="of the default classes only the 1-worker ones and our ConnectionPool client "
        "(fewer processes in the run)",
    )
    parser.add_argument(
        "--no-floor", action="store_true", help="leave out the plain uvicorn processes"
    )
    parser.add_argument(
        "--baseline",
        metavar="REV",
        help="also a multi-worker server (default settings) of this commit's code",
    )
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()

    variants: dict[str, list[str]] = {}
    if not args.no_defaults and not args.pool_only:
        variants["handoff on (default)"] = []
        variants["handoff off"] = ["--handoff", "off"]
    for spec in args.variant:
        name, _, flags = spec.partition("=")
        variants[name] = shlex.split(flags)
    workers = args.workers

    with contextlib.ExitStack() as stack:
        one = stack.enter_context(start_server(TARGET, "--debug-worker-header", workers=1))
        clients = {SINGLE: PooledClient(one, args.sessions)}
        stack.callback(clients[SINGLE].close)
        servers: dict[str, ServerProcess] = {}
        if args.baseline:
            (revision,) = stack.enter_context(_common.worktrees([args.baseline]))
            name = f"{args.baseline} (default settings)"
            servers[name] = stack.enter_context(
                _common.start_revision_server(
                    revision, TARGET, "--debug-worker-header", workers=workers
                )
            )
            clients[name] = PooledClient(servers[name], args.sessions)
            stack.callback(clients[name].close)
        for name, flags in variants.items():
            server = stack.enter_context(
                start_server(TARGET, *flags, "--debug-worker-header", workers=workers)
            )
            servers[name] = server
            clients[name] = PooledClient(server, args.sessions)
            stack.callback(clients[name].close)
        if not args.no_defaults and not args.pool_only:
            direct = DirectClient(servers["handoff on (default)"], args.sessions, workers)
            stack.callback(direct.close)
            clients[DIRECT] = direct
        if not args.no_defaults:
            # A server of its own: its /health counts are the pool's alone.
            servers[POOL_MANY] = stack.enter_context(
                start_server(TARGET, "--debug-worker-header", workers=workers)
            )
            for name, server in ((POOL_ONE, one), (POOL_MANY, servers[POOL_MANY])):
                pool_client = PoolClient(server, args.sessions)
                stack.callback(pool_client.close)
                clients[name] = pool_client  # type: ignore[assignment]
        if not args.no_floor:
            one_url, *turn_urls = stack.enter_context(plain_processes(1 + workers))
            plain: dict[str, PlainClient] = {
                PLAIN_ONE: PlainClient([one_url]),
                PLAIN_TURNS: PlainClient(turn_urls),
            }
            for client in plain.values():
                stack.callback(client.close)
        batches = {name: client.steps for name, client in clients.items()}
        if not args.no_floor:
            batches.update({name: client.steps for name, client in plain.items()})
        per_round = interleaved_rounds(
            batches, cycle=1, warmup=args.warmup, rounds=args.rounds, batch=args.batch
        )
        counts = {name: worker_deliveries(s.url, workers) for name, s in servers.items()}
        placed = {name: clients[name].holders() for name in servers}
        if POOL_MANY in clients:
            pool = cast(PoolClient, clients[POOL_MANY]).pool
            machine["pool_idle_connections_by_worker"] = {
                str(k): v for k, v in pool.idle_by_worker().items()
            }
        if DIRECT in clients:
            _common.check_connections(direct.groups)

    machine["loadavg_at_end"] = _common.os.getloadavg()
    report = summarize(per_round, args, machine, counts, placed)
    print_report(report)
    path = _common.write_json("pooled_connection", report)
    print(f"\nwrote {path}")


def summarize(
    per_round: dict[str, list[list[float]]],
    args: argparse.Namespace,
    machine: dict[str, Any],
    counts: dict[str, dict[str, Any]],
    placed: dict[str, dict[str, int]],
) -> dict[str, Any]:
    p50s = {k: [_common.percentile(b, 50) for b in v] for k, v in per_round.items()}
    p99s = {k: [_common.percentile(b, 99) for b in v] for k, v in per_round.items()}
    ratios = {
        k: {
            "over": BASELINE_OF.get(k, SINGLE),
            "p50": _common.median_ratio(p50s[k], p50s[BASELINE_OF.get(k, SINGLE)]),
            "p99": _common.median_ratio(p99s[k], p99s[BASELINE_OF.get(k, SINGLE)]),
        }
        for k in per_round
        if k not in {SINGLE, *BASELINE_OF.values()}
    }
    pooled = {k: _common.summary([x for b in v for x in b]) for k, v in per_round.items()}
    return {
        "machine": machine,
        "rounds": args.rounds,
        "batch": args.batch,
        "sessions": args.sessions,
        "workers": args.workers,
        "unit": "ms per request, client-side wall time of one /step",
        "pooled": pooled,
        "per_round_p50": p50s,
        "per_round_p99": p99s,
        "ratios_median_of_rounds": ratios,
        "sessions_per_worker": placed,
        "deliveries": counts,
        "targets": {"p50_over_1_worker": TARGET_RATIO},
    }


def print_report(report: dict[str, Any]) -> None:
    m = report["machine"]
    print(
        f"\n/step latency, {report['sessions']} sessions round robin on one kept-alive "
        f"connection; {report['rounds']} interleaved rounds x {report['batch']} steps per "
        f"class ({m['nproc']} cpus, load {m['loadavg_at_start'][0]:.2f} at start, "
        f"{m['loadavg_at_end'][0]:.2f} at end)\n"
    )
    rows = [
        [kind, s["n"], f"{s['p50']:.3f}", f"{s['p90']:.3f}", f"{s['p99']:.3f}"]
        for kind, s in report["pooled"].items()
    ]
    print(markdown_table(["class", "requests", "p50 ms", "p90 ms", "p99 ms"], rows))
    print()
    ratio_rows = [
        [
            f"{kind} / {'1 worker' if r['over'] == SINGLE else r['over']}",
            f"{r['p50']:.3f}",
            f"{r['p99']:.3f}",
            "(the machine's floor)" if r["over"] == PLAIN_ONE else f"<= {TARGET_RATIO}",
        ]
        for kind, r in report["ratios_median_of_rounds"].items()
    ]
    print(markdown_table(["median of per-round ratios", "p50", "p99", "p50 target"], ratio_rows))
    print()
    for name, workers in report["deliveries"].items():
        handed = sum(w.get("handed_over", 0) for w in workers.values())
        hopped = sum(w.get("hopped", 0) for w in workers.values())
        reasons: dict[str, int] = {}
        for w in workers.values():
            for reason, n in w.get("hop_reasons", {}).items():
                reasons[reason] = reasons.get(reason, 0) + n
        spread = sorted(report["sessions_per_worker"][name].values())
        print(
            f"{name}: sessions per worker {spread}; {handed} handed over, {hopped} hopped "
            f"{reasons} (/health)"
        )


if __name__ == "__main__":
    main()
