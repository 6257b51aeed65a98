"""The stress suite: every check of the reference's table, at its sizes or a small subset.

    .venv/bin/python -m tests.stress.run                 # reference sizes (minutes)
    .venv/bin/python -m tests.stress.run --scale small   # the default-suite subset
    .venv/bin/python -m tests.stress.run --env-workers 8
    .venv/bin/python -m tests.stress.run --hosts 2       # two hosts, Redis claims, nginx
    .venv/bin/python -m tests.stress.run --scale small --hog --repeat 5   # under a CPU hog

Prints the table and writes benchmarks/results/stress[_small].json (with
``--hog``: ``stress_small_hog.json``, every repetition's rows). The env
server is the counter with injected faults (tests/stress/targets.py) at 4 (or
8) workers, the agent is envs.counter_agent:CounterAgent at 4 workers, and
session_close_retry_window_seconds is 5 s. Real processes on loopback. With
``--hosts 2`` the checks that go through a load balancer run against two env
hosts (2 workers each) sharing claims in a real redis-server behind nginx, and
so do the multi-host faults: a 12 s step blocking a worker of each host, claim
keys deleted, claims and registrations forged, Redis frozen with SIGSTOP.
With ``--hog`` every repetition runs while one busy loop per core (other
processes, tests/stress/hog.py) competes for the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

from gym_sessions.server.process import start_server
from tests.services import run_nginx, run_redis, wait_for_registrations
from tests.stress import scenarios
from tests.stress.hog import cpu_hog
from tests.stress.scenarios import Row
from tests.stress.targets import FAULT_DIR_ENV

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
ENV_TARGET = "tests.stress.targets:FaultyCounterServer"
TALLY_TARGET = "tests.stress.targets:TallyServer"
AGENT_TARGET = "envs.counter_agent:CounterAgent"


#: The faults the two-host run injects while episodes run (`scenarios`).
LONG_STEPS = "long steps"
CLAIMS_DELETED = "claims deleted"
FORGED_ENTRIES = "forged entries"
REDIS_FROZEN = "redis frozen"


@dataclass(frozen=True)
class Sizes:
    runs: tuple[int, ...]
    each: int
    killed: int
    #: Multi-host faults to run (``each`` episodes apiece).
    faults: tuple[str, ...] = ()


FULL = Sizes(
    runs=(4_000, 10_000),
    each=1_000,
    killed=400,
    faults=(LONG_STEPS, CLAIMS_DELETED, FORGED_ENTRIES, REDIS_FROZEN),
)
# The default suite runs the faults that cost a few seconds; a 12 s step and a
# 5 s freeze are for the opt-in run.
SMALL = Sizes(runs=(300,), each=200, killed=80, faults=(CLAIMS_DELETED, FORGED_ENTRIES))


@contextlib.contextmanager
def fault_dir() -> Iterator[str]:
    """A private directory for the held-back replies' markers (tests/stress/targets.py)."""
    path = tempfile.mkdtemp(prefix="gs-faults-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_suite(
    sizes: Sizes, *, env_workers: int = 4, agent_workers: int = 4, window: float = 5.0
) -> list[Row]:
    """Start the servers, run every check, stop the servers; returns the rows."""
    args = ("--window", str(window))
    rows: list[Row] = []
    with (
        fault_dir() as faults,
        start_server(ENV_TARGET, *args, workers=env_workers, env={FAULT_DIR_ENV: faults}) as env,
        start_server(AGENT_TARGET, *args, "--allow-env", env.url, workers=agent_workers) as agent,
        start_server(TALLY_TARGET, *args, workers=4) as tally,
    ):

        async def main() -> None:
            for n in sizes.runs:
                rows.append(await scenarios.run_episodes(agent.url, env.url, n))
            rows.append(await scenarios.failed_seeds(env.url, sizes.each))
            rows.append(await scenarios.dropped_replies(env.url, sizes.each, faults))
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
    workers, file claims) reaches the env through nginx. Then the faults of
    ``sizes.faults``, and last whether any session or claim was left behind.
    """
    secret = secrets.token_hex(32)
    rows: list[Row] = []
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(run_redis())
        faults = stack.enter_context(fault_dir())
        args = ("--window", str(window), "--claims", store.url)
        hosts = [
            stack.enter_context(
                start_server(
                    ENV_TARGET,
                    *args,
                    workers=workers_per_host,
                    secret=secret,
                    env={FAULT_DIR_ENV: faults},
                )
            )
            for _ in range(2)
        ]
        wait_for_registrations(store.url, 2 * workers_per_host)
        balancer = stack.enter_context(run_nginx([host.url for host in hosts]))
        agent = stack.enter_context(
            start_server(
                AGENT_TARGET, "--window", str(window), "--allow-env", balancer.url, workers=4
            )
        )

        async def main() -> None:
            for n in sizes.runs:
                rows.append(await scenarios.run_episodes(agent.url, balancer.url, n))
            rows.append(await scenarios.failed_seeds(balancer.url, sizes.each))
            rows.append(await scenarios.dropped_replies(balancer.url, sizes.each, faults))
            rows.append(await scenarios.close_before_seed(balancer.url, sizes.each))
            rows.append(await scenarios.mcp_sequences(balancer.url, sizes.each))
            if LONG_STEPS in sizes.faults:
                rows.append(
                    await scenarios.long_steps(balancer.url, store.url, hosts, faults, sizes.each)
                )
            if CLAIMS_DELETED in sizes.faults:
                rows.append(await scenarios.claims_deleted(balancer.url, store.url, sizes.each))
            if FORGED_ENTRIES in sizes.faults:
                rows.append(await scenarios.forged_entries(balancer.url, store.url, sizes.each))
            if REDIS_FROZEN in sizes.faults:
                assert store.process is not None
                rows.append(
                    await scenarios.redis_frozen(balancer.url, store.process.pid, sizes.each)
                )
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
    parser.add_argument(
        "--hog", action="store_true", help="run while one busy loop per core competes"
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the suite this many times")
    args = parser.parse_args()
    sizes = FULL if args.scale == "full" else SMALL
    started = time.perf_counter()
    runs: list[dict] = []
    with cpu_hog() if args.hog else contextlib.nullcontext():
        for repetition in range(args.repeat):
            run_started = time.perf_counter()
            if args.hosts == 2:
                rows = run_multihost_suite(sizes)
            else:
                rows = run_suite(
                    sizes, env_workers=args.env_workers, agent_workers=args.agent_workers
                )
            seconds = time.perf_counter() - run_started
            print(format_table(rows))
            passed = all(r.ok for r in rows)
            print(
                f"\nrun {repetition + 1} of {args.repeat}: all checks passed: {passed}; "
                f"{seconds:.0f} s\n",
                flush=True,
            )
            runs.append({"seconds": seconds, "rows": [row.as_dict() for row in rows]})
    total = time.perf_counter() - started
    failed_runs = sum(not all(row["ok"] for row in run["rows"]) for run in runs)
    print(f"{len(runs) - failed_runs} of {len(runs)} runs passed every check; {total:.0f} s in all")
    name = "stress.json" if args.scale == "full" else "stress_small.json"
    if args.hosts == 2:
        name = name.replace(".json", "_2hosts.json")
    elif args.env_workers != 4:
        name = name.replace(".json", f"_{args.env_workers}workers.json")
    if args.hog:
        name = name.replace(".json", "_hog.json")
    report = {
        "scale": args.scale,
        "env_workers": args.env_workers if args.hosts == 1 else "2 hosts x 2",
        "agent_workers": args.agent_workers,
        "window_seconds": 5.0,
        "cpu_hog": f"{os.cpu_count()} busy loops (tests/stress/hog.py)" if args.hog else None,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "seconds": total,
        "rows": runs[-1]["rows"],
    }
    if args.repeat > 1:
        report["runs_passed"] = len(runs) - failed_runs
        report["runs"] = runs
    path = os.path.normpath(os.path.join(RESULTS_DIR, name))
    with open(path, "w") as file:
        json.dump(report, file, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
