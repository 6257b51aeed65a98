"""Per-step latency of `AsyncRemoteEnv` against OpenEnv 0.10.0's async WebSocket ``EnvClient``.

Two servers side by side, both at 4 uvicorn workers on loopback:

- ours: ``gym-sessions serve gym_sessions/Counter-v0 --workers 4``, driven by
  `AsyncRemoteEnv` (one kept-alive HTTP/1.1 connection, ``POST /step``; with
  ``--transport ws`` one ``/ws`` WebSocket, as OpenEnv's client keeps);
- OpenEnv's: ``uvicorn counter_app:app --workers 4`` (the same counter env on
  OpenEnv's ``create_app``, `benchmarks/openenv_side/counter_app.py`), driven
  by its async ``EnvClient`` over one WebSocket (`openenv_side/driver.py`).

OpenEnv pins an MCP version that conflicts with ours, so it lives in its own
venv (benchmarks/README.md has the commands; ``--openenv-python`` names its
interpreter, by default ``.peers/openenv/bin/python``). Each measurement is a
fresh client process: connect, reset, ``--warmup`` steps, then ``--steps``
timed steps one after another (``delta=1``), reporting each step's wall time
and the process's CPU time. Rounds alternate which client goes first; the
figure is the median over rounds of (our p50 / OpenEnv's p50) of that round.

    .venv/bin/python benchmarks/openenv_peer.py [--rounds 10] [--steps 2000] [--transport ws]
        [--concurrent 200 --concurrent-steps 6]

``--concurrent N`` adds to each round one more fresh process per side: N
clients at once, each a reset and ``--concurrent-steps`` steps (counts
checked), timed from the first connect to the last step; the figure is the
median over rounds of (our wall / OpenEnv's wall).

Prints a Markdown table; writes openenv_peer.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import _common

from gym_sessions.client import AsyncRemoteEnv
from gym_sessions.server.process import start_server
from tests.services import free_port

WORKERS = 4
HERE = os.path.dirname(os.path.abspath(__file__))
PEER_DIR = os.path.join(HERE, "openenv_side")
DEFAULT_PEER_PYTHON = os.path.join(_common.REPO, ".peers", "openenv", "bin", "python")


async def drive_ours(url: str, steps: int, warmup: int, transport: str) -> dict[str, Any]:
    """Our client's measurement (a child process: ``--drive URL STEPS WARMUP TRANSPORT``)."""
    async with AsyncRemoteEnv(url, transport=transport) as env:
        await env.reset(options={"initial_count": 0})
        for _ in range(warmup):
            await env.step(1)
        times = []
        cpu = time.process_time()
        for _ in range(steps):
            started = time.perf_counter()
            observation, *_ = await env.step(1)
            times.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        assert int(observation) == warmup + steps, observation
    return {"step_seconds": times, "cpu_seconds": cpu}


async def drive_ours_concurrent(
    url: str, sessions: int, steps: int, transport: str
) -> dict[str, Any]:
    """``sessions`` clients at once, each a reset and ``steps`` steps (``--drive-concurrent``)."""

    async def play(index: int) -> bool:
        async with AsyncRemoteEnv(url, transport=transport) as env:
            observation, _ = await env.reset(options={"initial_count": index})
            for _ in range(steps):
                observation, *_ = await env.step(1)
            return bool(int(observation) == index + steps)

    started = time.perf_counter()
    correct = await asyncio.gather(*(play(i) for i in range(sessions)))
    return {"wall_seconds": time.perf_counter() - started, "correct": sum(correct)}


def measure(command: list[str], cwd: str | None = None) -> dict[str, Any]:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"{command[:3]} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--openenv-python", default=DEFAULT_PEER_PYTHON)
    parser.add_argument("--transport", choices=("http", "ws"), default="http")
    parser.add_argument("--concurrent", type=int, default=0)
    parser.add_argument("--concurrent-steps", type=int, default=6)
    args = _common.parse_args(parser)
    if not os.path.exists(args.openenv_python):
        sys.exit(f"no OpenEnv venv at {args.openenv_python}: see benchmarks/README.md")

    port = free_port()
    peer = subprocess.Popen(
        [
            *(args.openenv_python, "-m", "uvicorn", "counter_app:app", "--port", str(port)),
            *("--workers", str(WORKERS), "--log-level", "warning"),
        ],
        cwd=PEER_DIR,
    )
    peer_url = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, Any]]] = {"gym-sessions": [], "openenv": []}
    walls: dict[str, list[float]] = {"gym-sessions": [], "openenv": []}
    try:
        _common.wait_for(peer_url)
        with start_server("gym_sessions/Counter-v0", workers=WORKERS) as ours:
            commands = {
                "gym-sessions": [sys.executable, __file__, "--drive", ours.url],
                "openenv": [args.openenv_python, "driver.py", peer_url],
            }
            together = {
                "gym-sessions": [sys.executable, __file__, "--drive-concurrent", ours.url],
                "openenv": [args.openenv_python, "driver.py", peer_url, "--concurrent"],
            }
            tail = {"gym-sessions": [args.transport], "openenv": []}
            for round_ in range(args.rounds):
                order = list(runs) if round_ % 2 == 0 else list(runs)[::-1]
                for name in order:
                    cwd = PEER_DIR if name == "openenv" else None
                    result = measure(
                        [*commands[name], str(args.steps), str(args.warmup), *tail[name]], cwd
                    )
                    p50 = statistics.median(result["step_seconds"]) * 1e3
                    runs[name].append(
                        {
                            "p50_ms": p50,
                            "p90_ms": _common.percentile(result["step_seconds"], 90) * 1e3,
                            "cpu_us_per_step": result["cpu_seconds"] / args.steps * 1e6,
                        }
                    )
                    print(f"round {round_} {name}: p50 {p50:.3f} ms", flush=True)
                if args.concurrent:
                    for name in order:
                        cwd = PEER_DIR if name == "openenv" else None
                        sizes = [str(args.concurrent), str(args.concurrent_steps)]
                        result = measure([*together[name], *sizes, *tail[name]], cwd)
                        walls[name].append(result["wall_seconds"])
                        print(
                            f"round {round_} {name}: {args.concurrent} x {args.concurrent_steps}"
                            f" wall {result['wall_seconds']:.3f} s, {result['correct']} correct",
                            flush=True,
                        )
    finally:
        peer.terminate()
        peer.wait(timeout=30)

    ratios = [
        ours["p50_ms"] / theirs["p50_ms"]
        for ours, theirs in zip(runs["gym-sessions"], runs["openenv"], strict=True)
    ]
    cpu_ratios = [
        ours["cpu_us_per_step"] / theirs["cpu_us_per_step"]
        for ours, theirs in zip(runs["gym-sessions"], runs["openenv"], strict=True)
    ]
    rows = []
    for name, rounds in runs.items():
        rows.append(
            [
                name,
                f"{statistics.median(r['p50_ms'] for r in rounds):.3f}",
                f"{min(r['p50_ms'] for r in rounds):.3f} - {max(r['p50_ms'] for r in rounds):.3f}",
                f"{statistics.median(r['p90_ms'] for r in rounds):.3f}",
                f"{statistics.median(r['cpu_us_per_step'] for r in rounds):.0f}",
            ]
        )
    wall_ratios = [
        ours / theirs for ours, theirs in zip(walls["gym-sessions"], walls["openenv"], strict=True)
    ]
    print(
        f"\nours over {args.transport}; counter env, {WORKERS} workers each, "
        f"{args.rounds} interleaved rounds of "
        f"{args.steps} steps, {os.cpu_count()} cpus, load average before {load_before[0]:.2f}\n"
    )
    print(
        _common.markdown_table(
            ["client", "p50 ms (median)", "p50 min - max", "p90 ms", "client CPU us/step"], rows
        )
    )
    spread = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"\nours / OpenEnv p50: {statistics.median(ratios):.2f} ({spread})")
    print(f"ours / OpenEnv client CPU per step: {statistics.median(cpu_ratios):.2f}")
    if wall_ratios:
        shown = ", ".join(f"{r:.2f}" for r in wall_ratios)
        print(
            f"{args.concurrent} concurrent sessions x {args.concurrent_steps} steps, wall: "
            f"ours {statistics.median(walls['gym-sessions']):.3f} s, OpenEnv "
            f"{statistics.median(walls['openenv']):.3f} s; ours / OpenEnv "
            f"{statistics.median(wall_ratios):.2f} ({shown})"
        )
    path = _common.write_json(
        "openenv_peer",
        {
            "workers": WORKERS,
            "transport": args.transport,
            "rounds": args.rounds,
            "concurrent": {"sessions": args.concurrent, "steps": args.concurrent_steps},
            "walls": walls,
            "wall_ratio_rounds": wall_ratios,
            "steps": args.steps,
            "machine": {**_common.machine(), "load_average_before": load_before},
            "runs": runs,
            "p50_ratio_rounds": ratios,
            "p50_ratio_median": statistics.median(ratios),
            "cpu_ratio_median": statistics.median(cpu_ratios),
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--drive":
        url, steps, warmup = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(asyncio.run(drive_ours(url, steps, warmup, sys.argv[5]))))
    elif len(sys.argv) == 6 and sys.argv[1] == "--drive-concurrent":
        url, sessions, steps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(asyncio.run(drive_ours_concurrent(url, sessions, steps, sys.argv[5]))))
    else:
        main()
