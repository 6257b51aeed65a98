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

``--pong raw`` (issue 32) measures Pong instead, N = 8, against one
``gym-sessions serve tests.e2e.pixel_envs:pong --workers 4`` (ALE
``Pong-v5``, 210x160x3 uint8 frames, frame skip 4) or, with ``--pong
preprocessed``, ``envs.atari:pong`` (``AtariPreprocessing`` + a stack of 4:
``(4, 84, 84)`` uint8, what a deep-RL agent is trained on); the ``atari``
extra. Configurations: ``make_vec`` as above (8 sessions spread over the 4
workers, two each: four ``/step_batch`` at once per vector step); ``make_vec
packed``: ``batch_group_size=64``, all 8 on one worker, one request per
vector step; ``local SyncVectorEnv``: the
same env, 8 copies in this process (``gymnasium.vector.SyncVectorEnv``), the
reference; ``local AsyncVectorEnv``: 8 copies, one process each (unless
``--no-local-async``). The figure is the median over rounds of each round's
``make_vec`` / ``local SyncVectorEnv`` steps/s. The server's CPU per step
(its process tree, from ``/proc``, during the timed steps) is reported beside
the caller's.

Rounds interleave the configurations (order rotated each round); each cell
is the median over rounds of (N x vector steps) / seconds, creation excluded,
and the batch gain is the median over rounds of each round's ``make_vec`` /
``make_vec /step`` ratio at the same N.
Random actions, NEXT_STEP autoreset (CartPole episodes end every ~20 steps, so
about 5% of sub-env steps are resets). Run from the repository root:

    .venv/bin/python benchmarks/vector_throughput.py [--rounds 5] [--make-vec-only] \
        [--baseline main]
    .venv/bin/python benchmarks/vector_throughput.py --pong raw [--rounds 5] [--pong-steps 300]

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
from collections.abc import Callable
from typing import Any

import _common
import gymnasium as gym
import numpy as np
from routing_cost import round_order

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.server.process import start_server

WORKERS = 4
# Vector steps per measurement: about a second or two each on 2 cores.
VECTOR_STEPS = {1: 1500, 8: 400, 64: 60}
WARMUP_STEPS = 10
STEP_MODE = "make_vec /step"
PACKED_MODE = "make_vec packed"
LOCAL_SYNC = "local SyncVectorEnv"
LOCAL_ASYNC = "local AsyncVectorEnv"
PONG_TARGETS = {"raw": "tests.e2e.pixel_envs:pong", "preprocessed": "envs.atari:pong"}
PONG_NUM_ENVS = 8
# Vector steps per Pong measurement: about 1-3 s each locally on 2 cores.
PONG_STEPS = {"raw": 300, "preprocessed": 100}


def pong_factory(kind: str) -> Callable[[], gym.Env]:
    """A function making one Pong env of ``kind`` (`PONG_TARGETS`) in this process."""
    if kind == "raw":
        from tests.e2e.pixel_envs import pong
    else:
        from envs.atari import pong
    return pong


def open_vector_env(url: str, mode: str, n: int, pong: str | None) -> gym.vector.VectorEnv:
    """The vector env of ``mode``; a local one is of ``pong``'s env (`PONG_TARGETS`)."""
    if mode == "make_vec":
        return gym.make_vec("gym_sessions/Remote-v0", num_envs=n, url=url)
    if mode == STEP_MODE:
        return gym.make_vec("gym_sessions/Remote-v0", num_envs=n, url=url, step_batch=False)
    if mode == PACKED_MODE:  # every session on one worker, one request per vector step
        return gym.make_vec("gym_sessions/Remote-v0", num_envs=n, url=url, batch_group_size=64)
    if mode == LOCAL_SYNC and pong is not None:
        return gym.vector.SyncVectorEnv([pong_factory(pong)] * n)
    if mode == LOCAL_ASYNC and pong is not None:
        return gym.vector.AsyncVectorEnv([pong_factory(pong)] * n)
    return gym.make_vec("gym_sessions/Remote-v0", num_envs=n, vectorization_mode="async", url=url)


def measure_revision(path: str, url: str, n: int, seed: int) -> dict[str, float]:
    """`measure` of ``make_vec`` in a child process importing the worktree at ``path``."""
    statements = "import vector_throughput as v; "
    statements += f"print(json.dumps(v.measure({url!r}, 'make_vec', {n}, {seed})))"
    return _common.run_in_worktree(path, statements, timeout=600)


def measure(
    url: str,
    mode: str,
    n: int,
    seed: int,
    pong: str | None = None,
    steps: int | None = None,
    server_pid: int | None = None,
) -> dict[str, float]:
    """One measurement: create, reset, warm up, time ``steps`` (``VECTOR_STEPS[n]``) steps, close.

    ``pong``: the `PONG_TARGETS` kind that the local modes make (and the server serves);
    ``server_pid``: the server's supervisor, whose process tree's CPU during the
    timed steps is counted.
    """
    steps = steps or VECTOR_STEPS[n]
    load = os.getloadavg()[0]
    started = time.perf_counter()
    envs = open_vector_env(url, mode, n, pong)
    try:
        created = time.perf_counter() - started
        envs.reset(seed=seed)
        rng = np.random.default_rng(seed)
        space = envs.single_action_space
        assert isinstance(space, gym.spaces.Discrete)
        actions = rng.integers(0, int(space.n), size=(WARMUP_STEPS + steps, n))
        for row in actions[:WARMUP_STEPS]:
            envs.step(row)
        server_cpu = 0.0 if server_pid is None else _common.tree_cpu_seconds(server_pid)
        cpu = time.process_time()
        started = time.perf_counter()
        for row in actions[WARMUP_STEPS:]:
            envs.step(row)
        seconds = time.perf_counter() - started
        cpu = time.process_time() - cpu
        if server_pid is not None:
            server_cpu = _common.tree_cpu_seconds(server_pid) - server_cpu
    finally:
        envs.close()
    steps *= n
    return {
        "steps_per_second": steps / seconds,
        "load_average_1min": load,
        "seconds": seconds,
        "create_seconds": created,
        # The calling process only (AsyncVectorEnv's workers are not counted).
        "caller_cpu_us_per_step": cpu / steps * 1e6,
        "server_cpu_us_per_step": server_cpu / steps * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-async-64", action="store_true", help="skip AsyncVectorEnv N=64")
    parser.add_argument(
        "--make-vec-only", action="store_true", help="only make_vec, with and without batches"
    )
    parser.add_argument("--baseline", help="also make_vec of this commit (client and server)")
    parser.add_argument(
        "--pong",
        choices=sorted(PONG_TARGETS),
        help="Pong instead of CartPole: make_vec of 8 vs local SyncVectorEnv (atari extra)",
    )
    parser.add_argument(
        "--pong-steps", type=int, help="vector steps per Pong measurement (default: by --pong)"
    )
    parser.add_argument(
        "--no-local-async", action="store_true", help="with --pong: skip local AsyncVectorEnv"
    )
    args = _common.parse_args(parser)
    if args.pong:
        run_pong(args)
        return
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


def run_pong(args: argparse.Namespace) -> None:
    """``--pong``: make_vec of 8 remote Pongs at 4 workers against the same env locally."""
    target = PONG_TARGETS[args.pong]
    steps = args.pong_steps or PONG_STEPS[args.pong]
    modes = ["make_vec", PACKED_MODE, LOCAL_SYNC] + ([] if args.no_local_async else [LOCAL_ASYNC])
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
    load_before = os.getloadavg()
    with start_server(target, workers=WORKERS) as server:
        for round_ in range(args.rounds):
            for mode in round_order(modes, round_):
                pid = server.process.pid if mode.startswith("make_vec") else None
                result = measure(server.url, mode, PONG_NUM_ENVS, round_, args.pong, steps, pid)
                runs[mode].append(result)
                print(
                    f"round {round_} {mode}: {result['steps_per_second']:.0f} steps/s "
                    f"(load {result['load_average_1min']:.2f})",
                    flush=True,
                )
    load_after = os.getloadavg()

    def per_round(mode: str, reference: str) -> list[float]:
        return [
            m["steps_per_second"] / r["steps_per_second"]
            for m, r in zip(runs[mode], runs[reference], strict=True)
        ]

    ratios = {
        f"{remote} / {local}": per_round(remote, local)
        for remote in ("make_vec", PACKED_MODE)
        for local in modes[2:]
    }
    print(
        f"\n{target} ({args.pong}), {PONG_NUM_ENVS} envs, server at {WORKERS} workers, "
        f"{args.rounds} interleaved rounds of {steps} vector steps, {os.cpu_count()} cpus, "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after\n"
    )
    rows = []
    for mode, rounds in runs.items():
        rates = [r["steps_per_second"] for r in rounds]
        loads = [r["load_average_1min"] for r in rounds]
        rows.append(
            [
                mode,
                f"{statistics.median(rates):.0f}",
                f"{min(rates):.0f} - {max(rates):.0f}",
                f"{statistics.median(r['caller_cpu_us_per_step'] for r in rounds):.0f}",
                f"{statistics.median(r['server_cpu_us_per_step'] for r in rounds):.0f}",
                f"{statistics.median(r['seconds'] for r in rounds) / steps * 1e3:.2f}",
                f"{min(loads):.1f} - {max(loads):.1f}",
            ]
        )
    headers = [
        "client",
        "steps/s (median)",
        "min - max",
        "caller CPU us/step",
        "server CPU us/step",
        "ms per vector step",
        "load (1 min)",
    ]
    print(_common.markdown_table(headers, rows))
    for name, values in ratios.items():
        spread = ", ".join(f"{x:.2f}" for x in values)
        print(f"\n{name}: {statistics.median(values):.2f} (per round: {spread})")
    path = _common.write_json(
        f"vector_throughput_pong_{args.pong}",
        {
            "env": target,
            "workers": WORKERS,
            "num_envs": PONG_NUM_ENVS,
            "rounds": args.rounds,
            "vector_steps": steps,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "load_average_before": load_before,
                "load_average_after": load_after,
            },
            "runs": runs,
            "ratios": {
                name: {"median": statistics.median(v), "rounds": v} for name, v in ratios.items()
            },
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
