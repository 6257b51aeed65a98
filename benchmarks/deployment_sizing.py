"""What a deployment sizes for: Redis memory per open session, descriptors and memory per worker.

One real ``redis-server`` on loopback (``tests.services.run_redis``, no
eviction), one ``gym-sessions serve`` of the counter env with ``--workers``
workers and ``--claims redis://...`` (with ``--durable-sessions`` unless
``--no-durable``). ``--sessions`` sessions are started (``/reset``, typed ids,
64 at once, a new connection each) and left open. Read before and after:

- ``redis-cli info memory`` (``used_memory``) and the number of keys;
- each worker's open descriptors (``/proc/<pid>/fd``) and resident memory
  (``VmRSS``), and the supervisor's.

Then ``--concurrent`` episodes are played at once through the server (new
connections), sampling the workers' descriptors every 20 ms: the peak under load.

    .venv/bin/python benchmarks/deployment_sizing.py [--sessions 10000] [--workers 2] [--no-durable]

Needs ``redis-server`` (``apt-get install -y redis-server``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from envs.counter_load import client_session, make_episodes, play_all
from gym_sessions.secret_source import write_secret_file
from gym_sessions.server.process import start_server
from tests.services import run_redis, wait_for_registrations

COUNTER = "gym_sessions.examples.counter:CounterEnv"


def redis_memory(port: int) -> tuple[int, int]:
    """``used_memory`` (bytes) from ``redis-cli info memory``, and the key count."""
    info = subprocess.run(
        ["redis-cli", "-p", str(port), "info", "memory"], check=True, capture_output=True,
        text=True,
    ).stdout  # fmt: skip
    used = next(
        int(line.split(":")[1]) for line in info.splitlines() if line.startswith("used_memory:")
    )
    keys = subprocess.run(
        ["redis-cli", "-p", str(port), "dbsize"], check=True, capture_output=True, text=True
    ).stdout
    return used, int(keys)


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


async def open_sessions(url: str, n: int) -> None:
    """Start ``n`` counter sessions and leave them open."""
    semaphore = asyncio.Semaphore(64)
    async with client_session() as client:

        async def start(episode) -> None:
            body = {"resources_session_id": episode.session_id, "session_key": episode.session_key,
                    "options": {"initial_count": episode.initial}}  # fmt: skip
            async with semaphore, client.post(url + "/reset", json=body) as reply:
                assert reply.status == 200, await reply.text()

        await asyncio.gather(*[start(e) for e in make_episodes(n, seed=5)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrent", type=int, default=200)
    parser.add_argument("--no-durable", action="store_true")
    args = parser.parse_args()
    with run_redis() as redis, tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        secret_file = os.path.join(tmp, "secret")
        write_secret_file(secret_file, secrets.token_hex(32))
        durable = () if args.no_durable else ("--durable-sessions",)
        server = start_server(
            COUNTER, "--claims", redis.url, "--secret-file", secret_file, *durable,
            workers=args.workers, tmpdir=tmp,
        )  # fmt: skip
        try:
            wait_for_registrations(redis.url, args.workers)
            port = int(redis.url.rsplit(":", 1)[1].split("/")[0])
            pids = server.worker_pids()
            before = redis_memory(port)
            fds_before = [descriptors(p) for p in pids]
            rss_before = [rss_mib(p) for p in pids]
            started = time.monotonic()
            asyncio.run(open_sessions(server.url, args.sessions))
            took = time.monotonic() - started
            time.sleep(2.5)  # a heartbeat, so the registrations' indexes are written
            after = redis_memory(port)
            fds_after = [descriptors(p) for p in pids]
            rss_after = [rss_mib(p) for p in pids]
            rss_supervisor = rss_mib(server.process.pid)

            peak = [0] * len(pids)
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    for i, pid in enumerate(pids):
                        peak[i] = max(peak[i], descriptors(pid))
                    time.sleep(0.02)

            sampler = threading.Thread(target=sample)
            sampler.start()
            episodes = asyncio.run(play_all(server.url, make_episodes(args.concurrent, seed=6)))
            done.set()
            sampler.join()
            assert all(e.reward == 1.0 for e in episodes)
        finally:
            server.stop()
    per_10k = (after[0] - before[0]) / args.sessions * 10_000
    mode = "claims only" if args.no_durable else "claims + durable snapshots"
    print(
        f"{args.sessions} open sessions ({mode}), {args.workers} workers, started in {took:.1f} s"
    )
    mib = [before[0] / 2**20, after[0] / 2**20, per_10k / 2**20]
    print(f"redis used_memory: {mib[0]:.1f} MiB -> {mib[1]:.1f} MiB ({mib[2]:.1f} MiB per 10k "
          f"sessions); keys {before[1]} -> {after[1]}")  # fmt: skip
    print(f"worker descriptors: idle {fds_before} -> {fds_after} with the sessions open; "
          f"peak {peak} with {args.concurrent} episodes at once")  # fmt: skip
    print(f"worker RSS MiB: {[round(r) for r in rss_before]} -> {[round(r) for r in rss_after]}; "
          f"supervisor {rss_supervisor:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
