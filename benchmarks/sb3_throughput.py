"""PPO timesteps per second through `RemoteVecEnv` at 4 workers vs a local ``DummyVecEnv``.

Against one ``gym-sessions serve CartPole-v1 --workers 4`` server, the same
seeded PPO (``MlpPolicy``, CPU, one torch thread, ``n_steps=128``, 4 envs,
``batch_size=128``, ``n_epochs=4``) learns ``--timesteps`` timesteps through:

- ``remote``: ``VecMonitor(RemoteVecEnv(url, num_envs=4))``;
- ``local``: ``VecMonitor(DummyVecEnv([gym.make("CartPole-v1")] * 4))``;
- ``remote @REV`` (``--baseline REV``): ``remote`` with that commit's client
  and server (a ``git worktree`` of it, the client in its own process, the
  server a second 4-worker server beside ours).

``--env pong`` (issue 32): the usual deep-RL Pong, ``envs.atari:pong``
(ALE ``Pong-v5`` with ``AtariPreprocessing`` and a stack of 4 frames,
``(4, 84, 84)`` uint8; the ``atari`` extra), served by ``gym-sessions serve
envs.atari:pong --workers 4`` and made locally by the same function; PPO with
``CnnPolicy`` (``n_steps=32``, ``batch_size=64``, ``n_epochs=2``: a rollout of
128 timesteps, then 4 minibatch updates per epoch), against the same local
``DummyVecEnv`` and ``local subproc``: ``SubprocVecEnv``, one process per
env (unless ``--no-subproc``). The figure is the median over rounds of each
round's remote / local ``DummyVecEnv`` rate.

Rounds interleave them (order rotated each round); each figure is the median
over rounds of timesteps / seconds of ``learn`` (env creation and PPO setup
excluded; PPO's own training epochs included, as a user sees them). Needs the
``sb3`` extra. Run from the repository root:

    .venv/bin/python benchmarks/sb3_throughput.py [--rounds 3] [--timesteps 4096] \
        [--baseline REV]
    .venv/bin/python benchmarks/sb3_throughput.py --env pong [--rounds 3] [--timesteps 2048]

Prints a Markdown table and writes sb3_throughput.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import _common
import gymnasium as gym
import torch
from routing_cost import round_order
from stable_baselines3 import PPO
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv, VecMonitor

from gym_sessions.integrations.sb3 import RemoteVecEnv
from gym_sessions.server.process import start_server

WORKERS = 4
NUM_ENVS = 4
#: ``--env`` -> (what the server serves, what the local envs are made of, policy, PPO options).
ENVS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "CartPole-v1": ("CartPole-v1", "MlpPolicy", {"n_steps": 128, "batch_size": 128, "n_epochs": 4}),
    "pong": ("envs.atari:pong", "CnnPolicy", {"n_steps": 32, "batch_size": 64, "n_epochs": 2}),
}
#: ``--timesteps`` when not given: a round of about 20-40 s per kind on 2 cores.
DEFAULT_TIMESTEPS = {"CartPole-v1": 4096, "pong": 2048}
SUBPROC = "local subproc"


def local_env(name: str) -> gym.Env:
    """One env of ``--env name`` made in this process (the same function as the server's)."""
    if name == "pong":
        from envs.atari import pong

        return pong()
    return gym.make(name)


def measure_revision(path: str, url: str, timesteps: int, seed: int) -> dict[str, float]:
    """`measure` of ``remote`` in a child process importing the worktree at ``path``."""
    statements = "import torch; torch.set_num_threads(1); import sb3_throughput as b; "
    statements += f"print(json.dumps(b.measure('remote', {url!r}, {timesteps}, {seed})))"
    return _common.run_in_worktree(path, statements, timeout=900)


def make_env(kind: str, url: str, name: str = "CartPole-v1") -> VecEnv:
    if kind == "remote":
        return VecMonitor(RemoteVecEnv(url, num_envs=NUM_ENVS))
    factories: list[Callable[[], gym.Env]] = [functools.partial(local_env, name)] * NUM_ENVS
    if kind == SUBPROC:
        return VecMonitor(SubprocVecEnv(factories))
    return VecMonitor(DummyVecEnv(factories))


def measure(
    kind: str, url: str, timesteps: int, seed: int, name: str = "CartPole-v1"
) -> dict[str, float]:
    """One PPO run of ``timesteps`` timesteps on ``--env name``; the rate of ``learn`` alone."""
    _, policy, options = ENVS[name]
    load = os.getloadavg()[0]
    env = make_env(kind, url, name)
    try:
        model = PPO(policy, env, seed=seed, device="cpu", verbose=0, **options)
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
        "load_average_1min": load,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timesteps", type=int, help="per run (default: by --env)")
    parser.add_argument("--env", choices=sorted(ENVS), default="CartPole-v1")
    parser.add_argument("--no-subproc", action="store_true", help="skip local SubprocVecEnv")
    parser.add_argument("--baseline", help="also remote with this commit (client and server)")
    args = _common.parse_args(parser)
    args.timesteps = args.timesteps or DEFAULT_TIMESTEPS[args.env]
    torch.set_num_threads(1)
    with contextlib.ExitStack() as stack:
        baseline = None
        if args.baseline:
            (revision,) = stack.enter_context(_common.worktrees([args.baseline]))
            server = stack.enter_context(
                _common.start_revision_server(revision, ENVS[args.env][0], workers=WORKERS)
            )
            baseline = (revision, server.url)
        run(args, baseline)


def run(args: argparse.Namespace, baseline: tuple[Any, str] | None) -> None:
    """The interleaved rounds and the report; ``baseline``: (revision, its server's URL)."""
    kinds = ["remote", "local"]
    if args.env == "pong" and not args.no_subproc:
        kinds.append(SUBPROC)
    base_kind = f"remote @{args.baseline}" if baseline is not None else None
    if base_kind is not None:
        kinds.append(base_kind)
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    load_before = os.getloadavg()
    with start_server(ENVS[args.env][0], workers=WORKERS) as server:
        for round_ in range(args.rounds):
            for kind in round_order(kinds, round_):
                if kind == base_kind and baseline is not None:
                    result = measure_revision(
                        baseline[0].path, baseline[1], args.timesteps, seed=round_
                    )
                else:
                    result = measure(kind, server.url, args.timesteps, round_, args.env)
                runs[kind].append(result)
                rate, load = result["timesteps_per_second"], result["load_average_1min"]
                print(
                    f"round {round_} {kind}: {rate:.0f} timesteps/s (load {load:.2f})", flush=True
                )
    load_after = os.getloadavg()

    medians = {
        kind: statistics.median(r["timesteps_per_second"] for r in rounds)
        for kind, rounds in runs.items()
    }
    ratio = medians["remote"] / medians["local"]
    target, policy, options = ENVS[args.env]
    print(
        f"\nPPO {policy} on {target}, {NUM_ENVS} envs, server at {WORKERS} workers, {options}, "
        f"{args.rounds} interleaved rounds of {args.timesteps} timesteps, "
        f"{os.cpu_count()} cpus, load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after\n"
    )
    print("| env | timesteps/s (median) | min - max | load (1 min) |")
    print("|---|---|---|---|")
    for kind, rounds in runs.items():
        rates = [r["timesteps_per_second"] for r in rounds]
        loads = [r.get("load_average_1min", float("nan")) for r in rounds]
        print(
            f"| {kind} | {medians[kind]:.0f} | {min(rates):.0f} - {max(rates):.0f} | "
            f"{min(loads):.1f} - {max(loads):.1f} |"
        )
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
        "sb3_throughput" if args.env == "CartPole-v1" else f"sb3_throughput_{args.env}",
        {
            "env": target,
            "policy": policy,
            "ppo_options": options,
            "workers": WORKERS,
            "num_envs": NUM_ENVS,
            "rounds": args.rounds,
            "timesteps": args.timesteps,
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "load_average_before": load_before,
                "load_average_after": load_after,
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
