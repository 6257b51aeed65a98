"""PPO timesteps per second through `RemoteVecEnv` at 4 workers vs a local ``DummyVecEnv``.

Against one ``gym-sessions serve CartPole-v1 --workers 4`` server, the same
seeded PPO (``MlpPolicy``, CPU, one torch thread, ``n_steps=128``, 4 envs,
``batch_size=128``, ``n_epochs=4``) learns ``--timesteps`` timesteps through:

- ``remote``: ``VecMonitor(RemoteVecEnv(url, num_envs=4))``;
- ``local``: ``VecMonitor(DummyVecEnv([gym.make("CartPole-v1")] * 4))``;
- ``remote @REV`` (``--baseline REV``): ``remote`` with that commit's client
  and server (a ``git worktree`` of it, the client in its own process, the
  server a second 4-worker server beside ours).

Rounds interleave them (order rotated each round); each figure is the median
over rounds of timesteps / seconds of ``learn`` (env creation and PPO setup
excluded; PPO's own training epochs included, as a user sees them). Needs the
``sb3`` extra. Run from the repository root:

    .venv/bin/python benchmarks/sb3_throughput.py [--rounds 3] [--timesteps 4096] \
        [--baseline REV]

Prints a Markdown table and writes sb3_throughput.json into --out DIR (default
benchmarks/results/local/, untracked).
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
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor

from gym_sessions.integrations.sb3 import RemoteVecEnv
from gym_sessions.server.process import start_server

WORKERS = 4
NUM_ENVS = 4


def measure_revision(path: str, url: str, timesteps: int, seed: int) -> dict[str, float]:
    """`measure` of ``remote`` in a child process importing the worktree at ``path``."""
    statements = "import torch; torch.set_num_threads(1); import sb3_throughput as b; "
    statements += f"print(json.dumps(b.measure('remote', {url!r}, {timesteps}, {seed})))"
    return _common.run_in_worktree(path, statements, timeout=900)


def make_env(kind: str, url: str) -> VecEnv:
    if kind == "remote":
        return VecMonitor(RemoteVecEnv(url, num_envs=NUM_ENVS))
    return VecMonitor(DummyVecEnv([lambda: gym.make("CartPole-v1") for _ in range(NUM_ENVS)]))


def measure(kind: str, url: str, timesteps: int, seed: int) -> dict[str, float]:
    """One PPO run of ``timesteps`` timesteps; the rate of ``learn`` alone."""
    env = make_env(kind, url)
    try:
        model = PPO(
            "MlpPolicy",
            env,
            n_steps=128,
            batch_size=128,
            n_epochs=4,
            seed=seed,
            device="cpu",
            verbose=0,
        )
        started = time.perf_counter()
        model.learn(total_timesteps=timesteps)
        seconds = time.perf_counter() - started
    finally:
        env.close()
    return {
        "timesteps_per_second": model.num_timesteps / seconds,
        "seconds": seconds,
        "timesteps": model.num_timesteps,
        "episodes_seen": len(model.ep_info_buffer),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timesteps", type=int, default=4096)
    parser.add_argument("--baseline", help="also remote with this commit (client and server)")
    args = _common.parse_args(parser)
    torch.set_num_threads(1)
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
    kinds = ["remote", "local"]
    base_kind = f"remote @{args.baseline}" if baseline is not None else None
    if base_kind is not None:
        kinds.append(base_kind)
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    load_before = os.getloadavg()
    with start_server("CartPole-v1", workers=WORKERS) as server:
        for round_ in range(args.rounds):
            shift = round_ % len(kinds)
            for kind in kinds[shift:] + kinds[:shift]:
                if kind == base_kind and baseline is not None:
                    result = measure_revision(
                        baseline[0].path, baseline[1], args.timesteps, seed=round_
                    )
                else:
                    result = measure(kind, server.url, args.timesteps, seed=round_)
                runs[kind].append(result)
                rate = result["timesteps_per_second"]
                print(f"round {round_} {kind}: {rate:.0f} timesteps/s", flush=True)

    medians = {
        kind: statistics.median(r["timesteps_per_second"] for r in rounds)
        for kind, rounds in runs.items()
    }
    ratio = medians["remote"] / medians["local"]
    print(
        f"\nPPO on CartPole-v1, {NUM_ENVS} envs, server at {WORKERS} workers, "
        f"{args.rounds} interleaved rounds of {args.timesteps} timesteps, "
        f"{os.cpu_count()} cpus, load average before {load_before[0]:.2f}\n"
    )
    print("| env | timesteps/s (median) | min - max |")
    print("|---|---|---|")
    for kind, rounds in runs.items():
        rates = [r["timesteps_per_second"] for r in rounds]
        print(f"| {kind} | {medians[kind]:.0f} | {min(rates):.0f} - {max(rates):.0f} |")
    print(f"\nremote / local: {ratio:.2f}")
    per_round = {
        other: [
            r["timesteps_per_second"] / o["timesteps_per_second"]
            for r, o in zip(runs["remote"], runs[other], strict=True)
        ]
        for other in kinds[1:]
    }
    for other, ratios in per_round.items():
        spread = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"remote / {other}, per round: {spread} (median {statistics.median(ratios):.2f})")

    path = _common.write_json(
        "sb3_throughput",
        {
            "env": "CartPole-v1",
            "workers": WORKERS,
            "num_envs": NUM_ENVS,
            "rounds": args.rounds,
            "timesteps": args.timesteps,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_before": load_before,
                "load_average_after": os.getloadavg(),
            },
            "median_timesteps_per_second": medians,
            "remote_over_local": ratio,
            "per_round_ratios": per_round,
            "baseline": None if baseline is None else baseline[0].commit,
            "runs": runs,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
