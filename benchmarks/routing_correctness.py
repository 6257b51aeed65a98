"""Before/after table: counter episodes scored correctly with 1 worker, 4 unrouted, 4 routed.

Every request goes on a new TCP connection, so uvicorn gives it to whichever
worker accepts it. Run from the repository root:

    .venv/bin/python benchmarks/routing_correctness.py [--episodes 200] [--rounds 3]

Prints a Markdown table and writes routing_correctness.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import _common

from envs.counter_load import make_episodes, play_all
from gym_sessions.server.process import start_server

CONFIGS = [
    ("1 worker", 1, ()),
    ("4 workers, --no-routing", 4, ("--no-routing",)),
    ("4 workers, routed", 4, ()),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = _common.parse_args(parser)

    rows = []
    for label, workers, extra in CONFIGS:
        with start_server("envs.counter:CounterEnv", *extra, workers=workers) as server:
            scores, seconds = [], []
            for round_ in range(args.rounds):
                episodes = make_episodes(args.episodes, seed=round_)
                started = time.perf_counter()
                done = asyncio.run(play_all(server.url, episodes))
                seconds.append(time.perf_counter() - started)
                scores.append(sum(e.reward == 1.0 for e in done))
        rows.append({"config": label, "workers": workers, "correct": scores, "seconds": seconds})

    print(f"\n{args.episodes} concurrent counter episodes per round, {args.rounds} rounds,")
    print("every request on a new connection\n")
    print("| server | reward 1.0 (per round) | reward 0.0 or error |")
    print("|---|---|---|")
    for row in rows:
        correct = row["correct"]
        low, high = min(correct), max(correct)
        shown = f"{low}" if low == high else f"{low} to {high}"
        wrong = args.episodes - high, args.episodes - low
        shown_wrong = f"{wrong[0]}" if wrong[0] == wrong[1] else f"{wrong[0]} to {wrong[1]}"
        print(f"| {row['config']} | {shown} of {args.episodes} | {shown_wrong} |")
    path = _common.write_json(
        "routing_correctness",
        {
            "episodes": args.episodes,
            "rounds": args.rounds,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "rows": rows,
        },
    )
    print(f"\nwrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
