"""Where a burst of sessions lands: HTTP starts (placed) against ``/ws`` starts (not placed).

``--sessions`` (200) `AsyncRemoteEnv`s at once against one 4-worker counter
server: each opens (``/spaces``), resets, takes ``--steps`` (6) steps and
closes, all concurrently, over HTTP (each env its own connection; balanced
placement spreads the starts) and over ``/ws`` (a start is held by the worker
that accepted the WebSocket, design §3.16). Transports alternate over
``--rounds``. Per round: sessions per worker once all are started (each
worker's ``/health``), and the wall time of the whole burst. Every count is
checked.

    .venv/bin/python benchmarks/session_spread.py [--rounds 4] [--sessions 200] [--steps 6]

Prints a Markdown table; writes session_spread.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import _common
from _common import markdown_table

from gym_sessions.client import AsyncRemoteEnv
from gym_sessions.server.process import start_server

TARGET = "envs.counter:CounterEnv"
TRANSPORTS = ("http", "ws")


def sessions_per_worker(url: str, workers: int) -> list[int]:
    """Each worker's open sessions, as its ``/health`` says, in increasing order."""
    return sorted(health["sessions"] for health in _common.worker_healths(url, workers).values())


async def burst(
    url: str, transport: str, sessions: int, steps: int, workers: int
) -> dict[str, Any]:
    """One burst: open and start every env, count them per worker, step, close; the wall."""
    envs = [AsyncRemoteEnv(url, transport=transport) for _ in range(sessions)]
    started = time.perf_counter()
    await asyncio.gather(*(env.open() for env in envs))
    await asyncio.gather(*(env.reset(options={"initial_count": k}) for k, env in enumerate(envs)))
    start_wall = time.perf_counter() - started
    spread = await asyncio.to_thread(sessions_per_worker, url, workers)
    paused = time.perf_counter()
    for _ in range(steps):
        observations = await asyncio.gather(*(env.step(1) for env in envs))
    await asyncio.gather(*(env.close() for env in envs))
    wall = start_wall + time.perf_counter() - paused
    expected = [k + steps for k in range(sessions)]
    if [int(observation) for observation, *_ in observations] != expected:
        raise RuntimeError(f"{transport}: a count went wrong")
    return {"spread": spread, "wall_seconds": wall, "start_seconds": start_wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--workers", type=int, default=4)
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TRANSPORTS}
    with start_server(TARGET, workers=args.workers) as server:
        for round_ in range(args.rounds):
            order = TRANSPORTS if round_ % 2 == 0 else TRANSPORTS[::-1]
            for transport in order:
                run = asyncio.run(
                    burst(server.url, transport, args.sessions, args.steps, args.workers)
                )
                runs[transport].append(run)
                print(f"round {round_} {transport}: {run['spread']} {run['wall_seconds']:.3f} s")
    machine["loadavg_at_end"] = _common.os.getloadavg()
    rows = [
        [
            transport,
            "; ".join(str(run["spread"]) for run in results),
            f"{statistics.median(r['wall_seconds'] for r in results):.3f}",
            f"{statistics.median(r['start_seconds'] for r in results):.3f}",
        ]
        for transport, results in runs.items()
    ]
    print(
        f"\n{args.sessions} sessions at once, {args.steps} steps each, {args.workers} workers, "
        f"{args.rounds} rounds\n"
    )
    print(
        markdown_table(
            ["transport", "sessions per worker, each round", "wall s (median)", "starts s"], rows
        )
    )
    report = {"machine": machine, "args": vars(args), "runs": runs}
    print(f"\nwrote {_common.write_json('session_spread', report)}")


if __name__ == "__main__":
    main()
