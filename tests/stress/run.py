"""The stress suite: every check of the reference's table, at its sizes or a small subset.

    .venv/bin/python -m tests.stress.run                 # reference sizes (minutes)
    .venv/bin/python -m tests.stress.run --scale small   # the default-suite subset
    .venv/bin/python -m tests.stress.run --env-workers 8
    .venv/bin/python -m tests.stress.run --hosts 2       # two hosts, Redis claims, nginx

Prints the table and writes benchmarks/results/stress[_small].json. The env
server is the counter with injected faults (tests/stress/targets.py) at 4 (or
8) workers, the agent is envs.counter:CounterAgent at 4 workers, and
session_close_retry_window_seconds is 5 s. Real processes on loopback. With
``--hosts 2`` the checks that go through a load balancer run against two env
hosts (2 workers each) sharing claims in a real redis-server behind nginx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import time
from dataclasses import dataclass

from gym_sessions.local_services import run_nginx, run_redis
from gym_sessions.server_process import start_server, wait_for_registrations
from tests.stress import scenarios
from tests.stress.scenarios import Row

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
ENV_TARGET = "tests.stress.targets:FaultyCounterServer"
TALLY_TARGET = "tests.stress.targets:TallyServer"
AGENT_TARGET = "envs.counter:CounterAgent"


@dataclass(frozen=True)
class Sizes:
    runs: tuple[int, ...]
    each: int
    killed: int


FULL = Sizes(runs=(4_000, 10_000), each=1_000, killed=400)
SMALL = Sizes(runs=(300,), each=200, killed=80)


def run_suite(
    sizes: Sizes, *, env_workers: int = 4, agent_workers: int = 4, window: float = 5.0
) -> list[Row]:
    """Start the servers, run every check, stop the servers; returns the rows."""
    args = ("--window", str(window))
    rows: list[Row] = []
    with (
        start_server(ENV_TARGET, *args, workers=env_workers) as env,
        start_server(AGENT_TARGET, *args, workers=agent_workers) as agent,
        start_server(TALLY_TARGET, *args, workers=4) as tally,
    ):

        async def main() -> None:
            for n in sizes.runs:
                rows.append(await scenarios.run_episodes(agent.url, env.url, n))
            rows.append(await scenarios.failed_seeds(env.url, sizes.each))
            rows.append(await scenarios.dropped_replies(env.url, sizes.each))
            rows.append(await scenarios.close_before_seed(env.url, sizes.each))
            rows.append(await scenarios.blind_starts(tally, 4, sizes.each))
            rows.append(await scenarios.mcp_sequences(env.url, sizes.each))
            rows.append(await scenarios.live_sessions_left(env, env_workers))
            rows.append(await scenarios.claims_left(env, window))

        asyncio.run(main())

    with start_server(ENV_TARGET, *args, workers=env_workers) as doomed:
        row = asyncio.run(scenarios.killed_worker(doomed, sizes.killed))
    # Its claims go with the runtime directory when the server exits.
    removed = not os.path.exists(row.detail["runtime_dir"])
    row.detail["runtime_dir_removed_at_exit"] = removed
    if not removed:
        row.correct = 0
    rows.append(row)
    return rows


def run_multihost_suite(
    sizes: Sizes, *, workers_per_host: int = 2, window: float = 5.0
) -> list[Row]:
    """The checks that go through a load balancer, on two hosts sharing Redis claims.

    One redis-server, two env "hosts" (``workers_per_host`` workers each, own
    ports and temporary directories), nginx round robin in front; the agent (4
    workers, file claims) reaches the env through nginx.
    """
    secret = secrets.token_hex(32)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(run_redis())
        args = ("--window", str(window), "--claims", store.url)
        hosts = [
            stack.enter_context(
                start_server(ENV_TARGET, *args, workers=workers_per_host, secret=secret)
            )
            for _ in range(2)
        ]
        wait_for_registrations(store.url, 2 * workers_per_host)
        balancer = stack.enter_context(run_nginx([host.url for host in hosts]))
        agent = stack.enter_context(start_server(AGENT_TARGET, "--window", str(window), workers=4))

        async def main() -> None:
            for n in sizes.runs:
                rows.append(await scenarios.run_episodes(agent.url, balancer.url, n))
            rows.append(await scenarios.failed_seeds(balancer.url, sizes.each))
            rows.append(await scenarios.dropped_replies(balancer.url, sizes.each))
            rows.append(await scenarios.close_before_seed(balancer.url, sizes.each))
            rows.append(await scenarios.mcp_sequences(balancer.url, sizes.each))
            for host in hosts:
                rows.append(await scenarios.live_sessions_left(host, workers_per_host))
            rows.append(await scenarios.redis_claims_left(store.url, window))

        asyncio.run(main())
    return rows


def format_table(rows: list[Row]) -> str:
    lines = ["| check | correct | wall time |", "|---|---|---|"]
    for row in rows:
        mark = "" if row.ok else " **FAILED**"
        lines.append(
            f"| {row.check} | {row.correct:,} of {row.total:,}{mark} | {row.seconds:.1f} s |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description="gym-sessions stress suite")
    parser.add_argument("--scale", choices=["full", "small"], default="full")
    parser.add_argument("--env-workers", type=int, default=4)
    parser.add_argument("--agent-workers", type=int, default=4)
    parser.add_argument(
        "--hosts", type=int, choices=[1, 2], default=1, help="2: two hosts with Redis claims"
    )
    args = parser.parse_args()
    sizes = FULL if args.scale == "full" else SMALL
    started = time.perf_counter()
    if args.hosts == 2:
        rows = run_multihost_suite(sizes)
    else:
        rows = run_suite(sizes, env_workers=args.env_workers, agent_workers=args.agent_workers)
    total = time.perf_counter() - started
    print(format_table(rows))
    print(f"\nall checks passed: {all(r.ok for r in rows)}; {total:.0f} s in all")
    name = "stress.json" if args.scale == "full" else "stress_small.json"
    if args.hosts == 2:
        name = name.replace(".json", "_2hosts.json")
    elif args.env_workers != 4:
        name = name.replace(".json", f"_{args.env_workers}workers.json")
    path = os.path.normpath(os.path.join(RESULTS_DIR, name))
    with open(path, "w") as file:
        json.dump(
            {
                "scale": args.scale,
                "env_workers": args.env_workers if args.hosts == 1 else "2 hosts x 2",
                "agent_workers": args.agent_workers,
                "window_seconds": 5.0,
                "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                "seconds": total,
                "rows": [row.as_dict() for row in rows],
            },
            file,
            indent=2,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
