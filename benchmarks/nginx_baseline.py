"""Baseline: nginx with sticky consistent hashing over 4 single-worker servers vs our routing.

Configurations, all serving ``envs.counter:CounterEnv`` on loopback, side by side:

- nginx (Debian's, a child process with its own temporary config, started by
  ``tests.services.run_nginx(..., balance="sticky_header")``) in
  front of 4 single-worker ``gym-sessions serve`` servers, ``hash
  $http_x_session_id consistent;`` with kept-alive upstream connections;
- our server with 4 routed workers;
- our server with 1 worker;
- our server with 4 workers and ``--no-routing`` (plain uvicorn workers).

The load is the counter task from a separate process (`_common.run_load`:
pooled kept-alive aiohttp client, 64 episodes in flight, at most 32
connections); every request carries its session id in ``X-Session-Id`` (the
typed reset names the same id), for every configuration. Configurations
alternate in rounds; ratios against our 4-worker server are the median of
per-round ratios.

    .venv/bin/python benchmarks/nginx_baseline.py [--episodes 400] [--rounds 5]

Needs ``nginx`` (on PATH or in /usr/sbin; ``apt-get install -y nginx``); exits 2 without it.
Prints a Markdown table; writes nginx_baseline.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess

import _common
from _common import markdown_table, run_load

from gym_sessions.server.process import start_server
from tests.services import run_nginx

TARGET = "envs.counter:CounterEnv"
BACKENDS = 4
NGINX = "nginx + 4 single-worker servers (sticky hash)"
OURS_4 = "ours, 4 workers routed"
OURS_1 = "ours, 1 worker"
NO_ROUTING = "4 workers --no-routing"
CONFIGS = (NGINX, OURS_4, OURS_1, NO_ROUTING)
WARMUP = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=400, help="timed episodes per run")
    parser.add_argument("--rounds", type=int, default=5)
    args = _common.parse_args(parser)
    nginx_program = _common.needs("nginx", "nginx", "nginx_baseline")
    print(_common.load_note())

    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        backends = [stack.enter_context(start_server(TARGET, workers=1)) for _ in range(BACKENDS)]
        front = stack.enter_context(run_nginx([b.url for b in backends], balance="sticky_header"))
        assert front.process is not None
        targets = {
            NGINX: (front.url, [front.process.pid, *(b.process.pid for b in backends)]),
        }
        for label, workers, extra in (
            (OURS_4, 4, ()),
            (OURS_1, 1, ()),
            (NO_ROUTING, 4, ("--no-routing",)),
        ):
            server = stack.enter_context(start_server(TARGET, *extra, workers=workers))
            targets[label] = (server.url, [server.process.pid])
        seed = 0
        for round_ in range(args.rounds):
            order = CONFIGS if round_ % 2 == 0 else tuple(reversed(CONFIGS))
            for label in order:
                url, pids = targets[label]
                seed += 1
                report = run_load(
                    url,
                    episodes=args.episodes,
                    seed=seed,
                    warmup=WARMUP,
                    session_header=True,
                    measure_pids=pids,
                )
                report.update(config=label, round=round_)
                runs.append(report)
                print(
                    f"  {label}, round {round_}: {report['episodes_per_second']:.0f} episodes/s, "
                    f"{report['correct']}/{report['episodes']} correct",
                    flush=True,
                )

    rows, summary = [], []
    for label in CONFIGS:
        mine = [r for r in runs if r["config"] == label]
        rates = [r["episodes_per_second"] for r in mine]
        eps = statistics.median(rates)
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        ratio = statistics.median(
            r["episodes_per_second"]
            / next(o for o in runs if o["config"] == OURS_4 and o["round"] == r["round"])[
                "episodes_per_second"
            ]
            for r in mine
        )
        correct = sum(r["correct"] for r in mine)
        total = sum(r["episodes"] for r in mine)
        server_ms = statistics.median(
            1000 * r["server_cpu_seconds_incl_warmup"] / (r["episodes"] + WARMUP) for r in mine
        )
        summary.append(
            {
                "config": label,
                "episodes_per_second_median": eps,
                "ratio_vs_ours_4_workers_median_of_rounds": ratio,
                "correct": correct,
                "episodes": total,
                "server_cpu_ms_per_episode": server_ms,
            }
        )
        rows.append(
            [
                label,
                f"{eps:.0f} ({spread})",
                f"{ratio:.2f}x",
                f"{100 * correct / total:.1f}% ({correct}/{total})",
                f"{server_ms:.2f}",
            ]
        )
    base, single = (next(s for s in summary if s["config"] == c) for c in (NGINX, OURS_1))
    print(
        f"\nCounter episodes per second, pooled keep-alive client in a separate process "
        f"(64 in flight, <= 32 connections, X-Session-Id on every request), "
        f"{args.rounds} rounds x {args.episodes} episodes\n"
    )
    print(
        markdown_table(
            [
                "configuration",
                "episodes/s median (min-max)",
                "vs ours 4 workers (median of rounds)",
                "correct",
                "server CPU ms/episode",
            ],
            rows,
        )
    )
    target = 1 / base["ratio_vs_ours_4_workers_median_of_rounds"]
    versus_single = 1 / single["ratio_vs_ours_4_workers_median_of_rounds"]
    print(f"\nours 4 workers / nginx sticky: {target:.2f}x (target >= 1.0)")
    print(f"ours 4 workers / ours 1 worker: {versus_single:.2f}x (target >= 1.0)")
    path = _common.write_json(
        "nginx_baseline",
        {
            "machine": _common.machine(),
            "nginx": subprocess.run(
                [nginx_program, "-v"], capture_output=True, text=True, check=False
            ).stderr.strip(),
            "episodes_per_run": args.episodes,
            "rounds": args.rounds,
            "warmup_per_run": WARMUP,
            "load": {"concurrency": 64, "limit": 32, "session_header": True},
            "ours_4_over_nginx": target,
            "ours_4_over_ours_1": versus_single,
            "summary": summary,
            "runs": runs,
        },
    )

    def draw(axes):  # type: ignore[no-untyped-def]
        _common.bars(
            axes,
            [s["config"] for s in summary],
            [s["episodes_per_second_median"] for s in summary],
            "episodes / s",
        )
        axes.set_title("Counter episodes/s: nginx sticky hashing vs routed workers")

    _common.figure("nginx_baseline", draw)
    print(f"wrote {path} and nginx_baseline.png")


if __name__ == "__main__":
    main()
