"""What ``--durable-sessions`` costs per ``/step``, and how long a restore takes.

Eight servers run side by side: the counter env and CartPole-v1, at 1 and 4
workers, with and without ``--durable-sessions``. On each, one kept-alive
connection starts a session (claimed by the worker that accepted it, so every
step is local: the snapshot write is all that differs) and steps it. Servers
are measured in interleaved rounds (a batch of steps on each per round, the
order rotating), so the shared machine's load drifts over all of them alike;
the durable/plain ratios are medians of per-round ratios of the batch p50.
With one worker there is nobody to restore onto, so the flag writes nothing:
that row is the control.

Restore latency: on the 4-worker durable servers, a session is started and
stepped over a connection its holder accepted, the holder is SIGKILLed, and the
next ``/step`` (on a new connection, accepted by a live worker) is timed: the
refused hop, the takeover, reading and verifying the snapshot, the rebuild and
the step. It is compared with a plain forwarded step of the same server.

    .venv/bin/python benchmarks/durable_sessions.py [--rounds 20] [--batch 100] [--kills 5]
    .venv/bin/python benchmarks/durable_sessions.py --claims redis   # needs redis-server

With ``--claims redis`` every server keeps its claims (and durable ones their
snapshots) in one real ``redis-server`` on loopback, as several hosts would;
a restore then waits for the dead worker's registration to lapse (about 12 s),
so the restore figure is that wait plus the takeover, and ``--kills`` defaults
to 2.

Prints Markdown tables; writes durable_sessions.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time
from typing import Any

import _common
from _common import RawConnection, markdown_table, median_ratio, percentile, session_cookie

from gym_sessions.server.process import ServerProcess, start_server
from tests.services import run_redis, wait_for_registrations

ENVS = {"counter": "envs.counter:CounterEnv", "cartpole": "CartPole-v1"}
WORKER_COUNTS = (1, 4)


class SteppedSession:
    """One session on one kept-alive connection, stepped in batches."""

    def __init__(self, server: ServerProcess, env: str) -> None:
        self.env = env
        self.connection = RawConnection(server.url)
        self.cookie = ""
        self.reset()

    @property
    def headers(self) -> dict[str, str]:
        return {"Cookie": f"{_common.COOKIE}={self.cookie}"} if self.cookie else {}

    def reset(self) -> None:
        # The same session again (its cookie): a new episode on the same env.
        status, data, response = self.connection.request(
            "POST", "/reset", {"seed": 0}, self.headers
        )
        assert status == 200, data
        self.cookie = session_cookie(response) or self.cookie

    def step(self, n: int, into: list[float]) -> None:
        for index in range(n):
            headers = self.headers
            action = 1 if self.env == "counter" else index % 2
            started = time.perf_counter()
            status, data, _ = self.connection.request("POST", "/step", {"action": action}, headers)
            into.append(time.perf_counter() - started)
            assert status == 200, data
            if data["terminated"] or data["truncated"]:
                self.reset()


def _restore_latencies(server: ServerProcess, env: str, kills: int) -> dict[str, Any]:
    """Seconds of the first request after SIGKILL of a session's holder, ``kills`` times."""
    restores, forwarded = [], []
    for _ in range(kills):
        session = SteppedSession(server, env)
        session.step(5, [])
        headers = session.headers
        # A forwarded step of the same session, for comparison: a connection
        # another worker accepted.
        for _ in range(50):
            other = RawConnection(server.url)
            if other.worker != session.connection.worker:
                break
            other.close()
        started = time.perf_counter()
        status, data, _ = other.request("POST", "/step", {"action": 0}, headers)
        forwarded.append(time.perf_counter() - started)
        assert status == 200, data
        os.kill(int(session.connection.worker.split("-")[0]), signal.SIGKILL)
        session.connection.close()
        time.sleep(0.3)  # the supervisor reaps it; the hop then refuses at once
        started = time.perf_counter()
        status, data, _ = other.request("POST", "/step", {"action": 0}, headers)
        restores.append(time.perf_counter() - started)
        assert status == 200, data
        other.close()
        time.sleep(1.5)  # let uvicorn's replacement worker come up before the next kill
    return {
        "restore_seconds": restores,
        "forwarded_seconds": forwarded,
        "restore_p50_ms": statistics.median(restores) * 1e3,
        "forwarded_p50_ms": statistics.median(forwarded) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=100, help="steps per server per round")
    parser.add_argument("--warmup", type=int, default=100, help="unrecorded steps per server")
    parser.add_argument("--kills", type=int, default=None, help="restores timed per env")
    parser.add_argument("--claims", choices=("file", "redis"), default="file")
    args = _common.parse_args(parser)
    kills = args.kills if args.kills is not None else (2 if args.claims == "redis" else 5)
    if args.claims == "redis":
        _common.needs("redis-server", "redis-server", "durable_sessions")
    print(_common.load_note())
    machine = _common.machine()

    keys = [(env, w, d) for env in ENVS for w in WORKER_COUNTS for d in (False, True)]
    with contextlib.ExitStack() as stack:
        claims: tuple[str, ...] = ()
        secret = None
        if args.claims == "redis":
            redis_url = stack.enter_context(run_redis()).url
            claims, secret = ("--claims", redis_url), "durable-bench-" + "s" * 32
        servers: dict[tuple[str, int, bool], ServerProcess] = {}
        sessions: dict[tuple[str, int, bool], SteppedSession] = {}
        registered = 0
        for key in keys:
            env, workers, durable = key
            flags = ("--durable-sessions",) if durable else ()
            server = stack.enter_context(
                start_server(
                    ENVS[env],
                    *flags,
                    *claims,
                    *_common.hop_only_args(),
                    workers=workers,
                    secret=secret,
                )
            )
            if claims:  # with Redis, ready means every worker registered
                registered += workers
                wait_for_registrations(claims[1], registered)
            servers[key] = server
            sessions[key] = SteppedSession(server, env)
            stack.callback(sessions[key].connection.close)
        for key in keys:
            sessions[key].step(args.warmup, [])
        per_round: dict[tuple[str, int, bool], list[list[float]]] = {k: [] for k in keys}
        for r in range(args.rounds):
            order = keys[r % len(keys) :] + keys[: r % len(keys)]
            for key in order:
                into: list[float] = []
                sessions[key].step(args.batch, into)
                per_round[key].append(into)

        rows, results = [], []
        for env in ENVS:
            for workers in WORKER_COUNTS:
                plain, durable = per_round[env, workers, False], per_round[env, workers, True]
                flat_plain = [t for batch in plain for t in batch]
                flat_durable = [t for batch in durable for t in batch]
                p50_ratio = median_ratio(
                    [percentile(b, 50) for b in durable], [percentile(b, 50) for b in plain]
                )
                p99_ratio = median_ratio(
                    [percentile(b, 99) for b in durable], [percentile(b, 99) for b in plain]
                )
                result = {
                    "env": env,
                    "workers": workers,
                    "plain_p50_us": percentile(flat_plain, 50) * 1e6,
                    "plain_p99_us": percentile(flat_plain, 99) * 1e6,
                    "durable_p50_us": percentile(flat_durable, 50) * 1e6,
                    "durable_p99_us": percentile(flat_durable, 99) * 1e6,
                    "p50_ratio": p50_ratio,
                    "p99_ratio": p99_ratio,
                    "per_round_p50_plain_us": [percentile(b, 50) * 1e6 for b in plain],
                    "per_round_p50_durable_us": [percentile(b, 50) * 1e6 for b in durable],
                }
                results.append(result)
                rows.append(
                    [
                        env,
                        workers,
                        f"{result['plain_p50_us']:.0f} / {result['plain_p99_us']:.0f}",
                        f"{result['durable_p50_us']:.0f} / {result['durable_p99_us']:.0f}",
                        f"{p50_ratio:.2f}x / {p99_ratio:.2f}x",
                    ]
                )
        print(
            f"\n/step, one kept-alive connection, local, {args.claims} claims; {args.rounds} "
            f"interleaved rounds of {args.batch} steps per server"
        )
        print(
            markdown_table(
                ["env", "workers", "plain p50 / p99 (µs)", "durable p50 / p99 (µs)", "ratio"],
                rows,
            )
        )
        restores = {}
        for env in ENVS:
            restores[env] = _restore_latencies(servers[env, 4, True], env, kills)
        print(
            f"\nFirst request after SIGKILL of the holder (4 workers, {kills} kills each, "
            f"{args.claims} claims)"
        )
        print(
            markdown_table(
                ["env", "restore p50 (ms)", "forwarded step p50 (ms)"],
                [
                    [env, f"{r['restore_p50_ms']:.2f}", f"{r['forwarded_p50_ms']:.2f}"]
                    for env, r in restores.items()
                ],
            )
        )
    name = "durable_sessions" if args.claims == "file" else "durable_sessions_redis"
    path = _common.write_json(
        name,
        {
            "machine": machine,
            "claims": args.claims,
            "rounds": args.rounds,
            "batch": args.batch,
            "steps": results,
            "restores": restores,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
