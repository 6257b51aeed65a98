"""Steps per second of N remote CartPole sessions: `RemoteVectorEnv` vs `AsyncVectorEnv`.

Against one ``gym-sessions serve CartPole-v1 --workers 4`` server:

- ``make_vec``: ``gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=N)``, one
  process, one event loop thread, N kept-alive connections (N = 1, 8, 64),
  stepping with one ``POST /step_batch`` per worker holding some sessions;
- ``make_vec /step``: the same with ``step_batch=False``: one ``POST /step``
  per sub-env, the path before batches (N = 8, 64);
- ``AsyncVectorEnv``: ``make_vec(..., vectorization_mode="async")``, one
  process per `RemoteEnv` (N = 1, 8, and 64 unless ``--no-async-64``).

Rounds interleave the configurations (order rotated each round); each cell
is the median over rounds of (N x vector steps) / seconds, creation excluded,
and the batch gain is the median over rounds of each round's ``make_vec`` /
``make_vec /step`` ratio at the same N.
Random actions, NEXT_STEP autoreset (CartPole episodes end every ~20 steps, so
about 5% of sub-env steps are resets). Run from the repository root:

    .venv/bin/python benchmarks/vector_throughput.py [--rounds 5] [--make-vec-only]

Prints a Markdown table and writes vector_throughput.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Any

import _common
import gymnasium as gym
import numpy as np

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.server.process import start_server

WORKERS = 4
# Vector steps per measurement: about a second or two each on 2 cores.
VECTOR_STEPS = {1: 1500, 8: 400, 64: 60}
WARMUP_STEPS = 10
STEP_MODE = "make_vec /step"


def measure(url: str, mode: str, n: int, seed: int) -> dict[str, float]:
    """One measurement: create, reset, warm up, time ``VECTOR_STEPS[n]`` steps, close."""
    started = time.perf_counter()
    if mode == "make_vec":
        envs = gym.make_vec("gym_sessions/Remote-v0", num_envs=n, url=url)
    elif mode == STEP_MODE:
        envs = gym.make_vec("gym_sessions/Remote-v0", num_envs=n, url=url, step_batch=False)
    else:
        envs = gym.make_vec(
            "gym_sessions/Remote-v0", num_envs=n, vectorization_mode="async", url=url
        )
    try:
        created = time.perf_counter() - started
        envs.reset(seed=seed)
        rng = np.random.default_rng(seed)
        actions = rng.integers(0, 2, size=(WARMUP_STEPS + VECTOR_STEPS[n], n))
        for row in actions[:WARMUP_STEPS]:
            envs.step(row)
        cpu = time.process_time()
        started = time.perf_counter()
        for row in actions[WARMUP_STEPS:]:
            envs.step(row)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu
    finally:
        envs.close()
    steps = n * VECTOR_STEPS[n]
    return {
        "steps_per_second": steps / seconds,
        "seconds": seconds,
        "create_seconds": created,
        # The calling process only (AsyncVectorEnv's workers are not counted).
        "caller_cpu_us_per_step": cpu / steps * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-async-64", action="store_true", help="skip AsyncVectorEnv N=64")
    parser.add_argument(
        "--make-vec-only", action="store_true", help="only make_vec, with and without batches"
    )
    args = _common.parse_args(parser)

    configs = [("make_vec", 1), ("make_vec", 8), ("make_vec", 64), (STEP_MODE, 8), (STEP_MODE, 64)]
    notes: list[str] = []
    if not args.make_vec_only:
        configs += [("AsyncVectorEnv", 1), ("AsyncVectorEnv", 8)]
    if args.make_vec_only or args.no_async_64:
        notes.append("AsyncVectorEnv N=64 skipped (--no-async-64)")
    else:
        configs.append(("AsyncVectorEnv", 64))

    runs: dict[str, list[dict[str, float]]] = {f"{m} N={n}": [] for m, n in configs}
    load_before = os.getloadavg()
    with start_server("CartPole-v1", workers=WORKERS) as server:
        for round_ in range(args.rounds):
            shift = round_ % len(configs)
            for mode, n in configs[shift:] + configs[:shift]:
                key = f"{mode} N={n}"
                if key not in runs:
                    continue
                try:
                    result = measure(server.url, mode, n, seed=round_)
                except Exception as exc:  # e.g. 64 processes too heavy for the machine
                    notes.append(f"{key} skipped in round {round_}: {type(exc).__name__}: {exc}")
                    del runs[key]
                    continue
                runs[key].append(result)
                print(f"round {round_} {key}: {result['steps_per_second']:.0f} steps/s", flush=True)

    rows: list[dict[str, Any]] = []
    for (mode, n), key in zip(configs, [f"{m} N={n}" for m, n in configs], strict=True):
        if key not in runs:
            continue
        rates = [r["steps_per_second"] for r in runs[key]]
        rows.append(
            {
                "client": mode,
                "num_envs": n,
                "median_steps_per_second": statistics.median(rates),
                "min": min(rates),
                "max": max(rates),
                "median_create_seconds": statistics.median(r["create_seconds"] for r in runs[key]),
                "median_caller_cpu_us_per_step": statistics.median(
                    r["caller_cpu_us_per_step"] for r in runs[key]
                ),
                "rounds": runs[key],
            }
        )

    gains: dict[int, dict[str, Any]] = {}
    for n in (8, 64):
        batched, single = runs.get(f"make_vec N={n}"), runs.get(f"{STEP_MODE} N={n}")
        if batched and single and len(batched) == len(single):
            ratios = [
                b["steps_per_second"] / s["steps_per_second"]
                for b, s in zip(batched, single, strict=True)
            ]
            gains[n] = {"median": statistics.median(ratios), "rounds": ratios}

    print(
        f"\nCartPole-v1 on {WORKERS} workers, {args.rounds} interleaved rounds, "
        f"{os.cpu_count()} cpus, load average before {load_before[0]:.2f}\n"
    )
    print("| client | N | steps/s (median) | min - max | create s | caller CPU us/step |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['client']} | {row['num_envs']} | {row['median_steps_per_second']:.0f} | "
            f"{row['min']:.0f} - {row['max']:.0f} | {row['median_create_seconds']:.2f} | "
            f"{row['median_caller_cpu_us_per_step']:.0f} |"
        )
    for n, gain in gains.items():
        spread = ", ".join(f"{r:.2f}" for r in gain["rounds"])
        print(
            f"\nbatch gain at N={n} (make_vec / make_vec /step): {gain['median']:.2f}x ({spread})"
        )
    for note in notes:
        print(f"\nnote: {note}")

    path = _common.write_json(
        "vector_throughput",
        {
            "env": "CartPole-v1",
            "workers": WORKERS,
            "rounds": args.rounds,
            "vector_steps": VECTOR_STEPS,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
            },
            "rows": rows,
            "batch_gain": gains,
            "notes": notes,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
