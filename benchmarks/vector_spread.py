"""Steps per second of a `RemoteVectorEnv` of 8 on a CPU-heavy env: spread vs packed sessions.

Three ``gym-sessions serve envs.cpu_counter:CpuCounterEnv`` servers side by
side, at 1, 2 and 4 workers (each sub-env step burns about 1 ms of CPU on its
holder; ``--env CartPole-v1``: a step that costs far less than its request).
Against each, ``gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=8)``:

- ``spread`` (the default since issue 29 item 9): each session starts over its
  own connection, one after another, so balanced placement spreads them over
  the workers (2 each at 4 workers); a step is one ``/step_batch`` per holder,
  sent at once;
- ``packed`` (``batch_group_size=64``, the old default): every session starts
  beside the first one's, so one worker holds all 8 and one request steps them.

Rounds interleave the six configurations (order rotated each round); each
cell is the median over rounds of (8 x vector steps) / seconds, creation and
the first reset excluded (random actions, NEXT_STEP autoreset), and the gain
is the median over rounds of each round's spread / packed ratio at the same
worker count. The placement of every measured env (sessions per worker) is
printed and kept in the JSON.
Run from the repository root:

    .venv/bin/python benchmarks/vector_spread.py [--rounds 5] [--steps 200] [--env CartPole-v1]

Prints a Markdown table and writes vector_spread.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections import Counter
from typing import Any

import _common
import gymnasium as gym

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.server.process import start_server

ENV = "envs.cpu_counter:CpuCounterEnv"
NUM_ENVS = 8
WORKER_COUNTS = (1, 2, 4)
#: ``batch_group_size`` of each mode.
MODES = {"spread": None, "packed": 64}
WARMUP_STEPS = 10


def measure(server: Any, mode: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """One measurement: create, reset, warm up, time ``steps`` vector steps, close."""
    envs = gym.make_vec(
        "gym_sessions/Remote-v0", num_envs=NUM_ENVS, url=server.url, batch_group_size=MODES[mode]
    )
    try:
        started = time.perf_counter()
        envs.reset(seed=seed)
        reset_seconds = time.perf_counter() - started
        envs.action_space.seed(seed)
        actions = [envs.action_space.sample() for _ in range(WARMUP_STEPS + steps)]
        for row in actions[:WARMUP_STEPS]:
            envs.step(row)
        cpu = time.process_time()
        server_cpu = _common.tree_cpu_seconds(server.process.pid)
        started = time.perf_counter()
        for row in actions[WARMUP_STEPS:]:
            envs.step(row)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu
        server_cpu = _common.tree_cpu_seconds(server.process.pid) - server_cpu
        per_worker = sorted(Counter(envs.unwrapped.workers).values(), reverse=True)
    finally:
        envs.close()
    return {
        "steps_per_second": NUM_ENVS * steps / seconds,
        "seconds": seconds,
        "first_reset_seconds": reset_seconds,
        "caller_cpu_us_per_step": cpu / (NUM_ENVS * steps) * 1e6,
        # All the server's processes (the env's own step included), in clock ticks.
        "server_cpu_us_per_step": server_cpu / (NUM_ENVS * steps) * 1e6,
        "sessions_per_worker": per_worker,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200, help="timed vector steps per cell")
    parser.add_argument(
        "--env", default=ENV, help="served env (default: %(default)s; CartPole-v1: a cheap step)"
    )
    args = _common.parse_args(parser)
    configs = [(mode, workers) for workers in WORKER_COUNTS for mode in MODES]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {config: [] for config in configs}
    info = _common.machine()
    with contextlib.ExitStack() as stack:
        servers = {w: stack.enter_context(start_server(args.env, workers=w)) for w in WORKER_COUNTS}
        for round_ in range(args.rounds):
            shift = round_ % len(configs)
            for mode, workers in configs[shift:] + configs[:shift]:
                result = measure(servers[workers], mode, args.steps, seed=round_)
                runs[mode, workers].append(result)
                print(
                    f"round {round_} {mode} at {workers} workers: "
                    f"{result['steps_per_second']:.0f} steps/s, "
                    f"sessions per worker {result['sessions_per_worker']}",
                    flush=True,
                )

    headers = ["workers", "mode", "steps/s (median)", "min - max", "sessions per worker"]
    headers += ["first reset ms", "caller CPU us/step", "server CPU us/step"]
    rows: list[list[Any]] = []
    gains: dict[int, dict[str, Any]] = {}
    for workers in WORKER_COUNTS:
        for mode in MODES:
            cell = runs[mode, workers]
            rates = [r["steps_per_second"] for r in cell]
            placements = Counter(str(r["sessions_per_worker"]) for r in cell)
            rows.append(
                [
                    workers,
                    mode,
                    f"{statistics.median(rates):.0f}",
                    f"{min(rates):.0f} - {max(rates):.0f}",
                    ", ".join(f"{p} x{k}" for p, k in placements.items()),
                    f"{statistics.median(r['first_reset_seconds'] for r in cell) * 1e3:.0f}",
                    f"{statistics.median(r['caller_cpu_us_per_step'] for r in cell):.0f}",
                    f"{statistics.median(r['server_cpu_us_per_step'] for r in cell):.0f}",
                ]
            )
        ratios = [
            s["steps_per_second"] / p["steps_per_second"]
            for s, p in zip(runs["spread", workers], runs["packed", workers], strict=True)
        ]
        gains[workers] = {"median": statistics.median(ratios), "rounds": ratios}

    print(
        f"\n{args.env}, {NUM_ENVS} sub-envs, {args.rounds} interleaved rounds of {args.steps} "
        f"vector steps, {_common.load_note()} (at start: {info['loadavg_at_start'][0]:.2f})\n"
    )
    print(_common.markdown_table(headers, rows))
    for workers, gain in gains.items():
        spread = ", ".join(f"{r:.2f}" for r in gain["rounds"])
        print(f"\nspread / packed at {workers} workers: {gain['median']:.2f}x ({spread})")
    path = _common.write_json(
        "vector_spread",
        {
            "env": args.env,
            "num_envs": NUM_ENVS,
            "rounds": args.rounds,
            "vector_steps": args.steps,
            "machine": info,
            "runs": {f"{mode} {workers}": cell for (mode, workers), cell in runs.items()},
            "gains": gains,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
