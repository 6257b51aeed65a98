"""Steps per second of N remote CartPole sessions: `RemoteVectorEnv` vs `AsyncVectorEnv`.

Against one ``gym-sessions serve CartPole-v1 --workers 4`` server:

- ``make_vec``: ``gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=N)``, one
  process, one event loop thread, N kept-alive connections (N = 1, 8, 64),
  stepping with one ``POST /step_batch`` per worker holding some sessions;
- ``make_vec /step``: the same with ``step_batch=False``: one ``POST /step``
  per sub-env (N = 8, 64);
- ``make_vec @REV`` (``--baseline REV``, e.g. ``main``): ``make_vec`` of that
  commit, client and server both (a ``git worktree`` of it, the client in its
  own process, the server a second 4-worker server beside ours), N = 8, 64;
- ``AsyncVectorEnv``: ``make_vec(..., vectorization_mode="async")``, one
  process per `RemoteEnv` (N = 1, 8, and 64 unless ``--no-async-64``).

Rounds interleave the configurations (order rotated each round); each cell
is the median over rounds of (N x vector steps) / seconds, creation excluded,
and the batch gain is the median over rounds of each round's ``make_vec`` /
``make_vec /step`` ratio at the same N.
Random actions, NEXT_STEP autoreset (CartPole episodes end every ~20 steps, so
about 5% of sub-env steps are resets). Run from the repository root:

    .venv/bin/python benchmarks/vector_throughput.py [--rounds 5] [--make-vec-only] \
        [--baseline main]

Prints a Markdown table and writes vector_throughput.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
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


def measure_revision(path: str, url: str, n: int, seed: int) -> dict[str, float]:
    """`measure` of ``make_vec`` in a child process importing the worktree at ``path``."""
    statements = "import vector_throughput as v; "
    statements += f"print(json.dumps(v.measure({url!r}, 'make_vec', {n}, {seed})))"
    return _common.run_in_worktree(path, statements, timeout=600)


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
    parser.add_argument("--baseline", help="also make_vec of this commit (client and server)")
    args = _common.parse_args(parser)
    with contextlib.ExitStack() as stack:
        baseline = None
        if args.baseline:
            (revision,) = stack.enter_context(_common.worktrees([args.baseline]))
            server = stack.enter_context(
                _common.start_revision_server(revision, "CartPole-v1", workers=WORKERS)
            )
            baseline = (revision, server.url)
        run(args, baseline)


def run(args: argparse.Namespace, baseline: tuple[Any, str] | None) -> None:
    """The interleaved rounds and the report; ``baseline``: (revision, its server's URL)."""

    configs = [("make_vec", 1), ("make_vec", 8), ("make_vec", 64), (STEP_MODE, 8), (STEP_MODE, 64)]
    notes: list[str] = []
    if not args.make_vec_only:
        configs += [("AsyncVectorEnv", 1), ("AsyncVectorEnv", 8)]
    base_mode = f"make_vec @{args.baseline}" if baseline else None
    if base_mode:
        configs += [(base_mode, 8), (base_mode, 64)]
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
                    if mode == base_mode and baseline is not None:
                        result = measure_revision(baseline[0].path, baseline[1], n, seed=round_)
                    else:
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

    gains: dict[str, dict[str, Any]] = {}
    for other in (STEP_MODE, base_mode):
        for n in (8, 64):
            batched, single = runs.get(f"make_vec N={n}"), runs.get(f"{other} N={n}")
            if batched and single and len(batched) == len(single):
                ratios = [
                    b["steps_per_second"] / s["steps_per_second"]
                    for b, s in zip(batched, single, strict=True)
                ]
                gains[f"{other} N={n}"] = {"median": statistics.median(ratios), "rounds": ratios}

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
    for key, gain in gains.items():
        spread = ", ".join(f"{r:.2f}" for r in gain["rounds"])
        print(f"\nmake_vec / {key}: {gain['median']:.2f}x ({spread})")
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
            "baseline": None if baseline is None else baseline[0].commit,
            "gains": gains,
            "notes": notes,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
