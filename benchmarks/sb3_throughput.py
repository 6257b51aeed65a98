"""PPO timesteps per second through `RemoteVecEnv` at 4 workers vs a local ``DummyVecEnv``.

Against one ``gym-sessions serve CartPole-v1 --workers 4`` server, the same
seeded PPO (``MlpPolicy``, CPU, one torch thread, ``n_steps=128``, 4 envs,
``batch_size=128``, ``n_epochs=4``) learns ``--timesteps`` timesteps through:

- ``remote``: ``VecMonitor(RemoteVecEnv(url, num_envs=4))``;
- ``local``: ``VecMonitor(DummyVecEnv([gym.make("CartPole-v1")] * 4))``.

Rounds interleave the two (order swapped each round); each figure is the median
over rounds of timesteps / seconds of ``learn`` (env creation and PPO setup
excluded; PPO's own training epochs included, as a user sees them). Needs the
``sb3`` extra. Run from the repository root:

    .venv/bin/python benchmarks/sb3_throughput.py [--rounds 3] [--timesteps 4096]

Prints a Markdown table and writes sb3_throughput.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import _common
import gymnasium as gym
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecMonitor

from gym_sessions.integrations.sb3 import RemoteVecEnv
from gym_sessions.server.process import start_server

WORKERS = 4
NUM_ENVS = 4


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
    args = _common.parse_args(parser)
    torch.set_num_threads(1)

    runs: dict[str, list[dict[str, float]]] = {"remote": [], "local": []}
    load_before = os.getloadavg()
    with start_server("CartPole-v1", workers=WORKERS) as server:
        for round_ in range(args.rounds):
            order = ["remote", "local"] if round_ % 2 == 0 else ["local", "remote"]
            for kind in order:
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
            "runs": runs,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
