"""Episodes per second of the counter task with 1, 2 and 4 routed workers, under concurrent load.

An episode is the counter task (typed reset, 3-6 steps, verify with a close
following, close). The load comes from a separate process
(``benchmarks/_common.py load``: `envs.counter_load.play` over one aiohttp
client, 64 episodes in flight, at most 32 connections), in two client modes:

- pooled: kept-alive connections shared by all episodes (each request takes
  the connection aiohttp's pool hands out; ``forwarded_fraction.py`` measures
  how many of them reach a worker that does not hold the session);
- fresh: a new TCP connection for every request.

Then the same with ``envs.cpu_counter:CpuCounterEnv``, whose step burns ~1 ms
of CPU, pooled only: how workers scale when the env is the work. Servers of a
phase run side by side and the configurations alternate in rounds; ratios are
the median of per-round ratios against the 1-worker server. Server CPU is the
supervisor's and workers' CPU time over a run (warm-up included) per episode;
"cores busy" multiplies it (and the client's) by the episode rate, to show
when the machine (nproc cores, shared) is the limit rather than the server.

    .venv/bin/python benchmarks/throughput.py [--episodes 400] [--rounds 5]

Prints Markdown tables; writes throughput.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import _common
from _common import markdown_table, run_load

from gym_sessions.server.process import start_server

WORKERS = (1, 2, 4)
PHASES = (
    # (name, target, client modes, episodes scale)
    ("counter", "envs.counter:CounterEnv", ("pooled", "fresh"), 1.0),
    ("cpu counter (1 ms/step)", "envs.cpu_counter:CpuCounterEnv", ("pooled",), 0.5),
)
WARMUP = 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=400, help="timed episodes per run")
    parser.add_argument("--rounds", type=int, default=5)
    args = _common.parse_args(parser)
    print(_common.load_note())

    runs: list[dict] = []
    seed = 0
    for phase, target, modes, scale in PHASES:
        episodes = max(1, int(args.episodes * scale))
        with contextlib.ExitStack() as stack:
            servers = {n: stack.enter_context(start_server(target, workers=n)) for n in WORKERS}
            for round_ in range(args.rounds):
                for mode in modes:
                    order = WORKERS if round_ % 2 == 0 else tuple(reversed(WORKERS))
                    for workers in order:
                        server = servers[workers]
                        seed += 1
                        report = run_load(
                            server.url,
                            episodes=episodes,
                            seed=seed,
                            fresh=mode == "fresh",
                            warmup=WARMUP,
                            measure_pids=[server.process.pid],
                        )
                        report.update(phase=phase, mode=mode, workers=workers, round=round_)
                        runs.append(report)
                        print(
                            f"  {phase}, {mode}, {workers} worker(s), round {round_}: "
                            f"{report['episodes_per_second']:.0f} episodes/s, "
                            f"{report['correct']}/{report['episodes']} correct",
                            flush=True,
                        )

    rows, summary = table(runs)
    print(
        f"\nCounter episodes per second, load from a separate process (64 in flight, "
        f"<= 32 connections), {args.rounds} rounds x {args.episodes} episodes "
        f"(cpu counter: x {PHASES[1][3]}); vs 1 worker: median of per-round ratios\n"
    )
    print(
        markdown_table(
            [
                "env",
                "client",
                "workers",
                "episodes/s median (min-max)",
                "vs 1 worker",
                "correct",
                "server CPU ms/episode",
                "client CPU ms/episode",
                "cores busy: server + client",
            ],
            rows,
        )
    )
    path = _common.write_json(
        "throughput",
        {
            "machine": _common.machine(),
            "episodes_per_run": args.episodes,
            "rounds": args.rounds,
            "warmup_per_run": WARMUP,
            "load": {"concurrency": 64, "limit": 32},
            "summary": summary,
            "runs": runs,
        },
    )
    plot(summary)
    print(f"\nwrote {path} and throughput.png")


def spread(runs: list[dict]) -> str:
    rates = [r["episodes_per_second"] for r in runs]
    return f"{min(rates):.0f}-{max(rates):.0f}"


def table(runs: list[dict]) -> tuple[list[list], list[dict]]:
    rows, summary = [], []
    for phase, _, modes, _ in PHASES:
        for mode in modes:
            chosen = [r for r in runs if r["phase"] == phase and r["mode"] == mode]
            by_round: dict[int, dict[int, float]] = {}
            for r in chosen:
                by_round.setdefault(r["round"], {})[r["workers"]] = r["episodes_per_second"]
            for workers in WORKERS:
                mine = [r for r in chosen if r["workers"] == workers]
                eps = statistics.median(r["episodes_per_second"] for r in mine)
                ratio = statistics.median(
                    rounds[workers] / rounds[1] for rounds in by_round.values()
                )
                correct = sum(r["correct"] for r in mine)
                total = sum(r["episodes"] for r in mine)
                server_ms = statistics.median(
                    1000 * r["server_cpu_seconds_incl_warmup"] / (r["episodes"] + WARMUP)
                    for r in mine
                )
                client_ms = statistics.median(
                    1000 * r["client_cpu_seconds"] / r["episodes"] for r in mine
                )
                summary.append(
                    {
                        "phase": phase,
                        "mode": mode,
                        "workers": workers,
                        "episodes_per_second_median": eps,
                        "ratio_vs_1_worker_median_of_rounds": ratio,
                        "correct": correct,
                        "episodes": total,
                        "server_cpu_ms_per_episode": server_ms,
                        "client_cpu_ms_per_episode": client_ms,
                    }
                )
                rows.append(
                    [
                        phase,
                        mode,
                        workers,
                        f"{eps:.0f} ({spread(mine)})",
                        f"{ratio:.2f}x",
                        f"{correct}/{total}",
                        f"{server_ms:.2f}",
                        f"{client_ms:.2f}",
                        f"{eps * server_ms / 1000:.2f} + {eps * client_ms / 1000:.2f}",
                    ]
                )
    return rows, summary


def plot(summary: list[dict]) -> None:
    groups = sorted(
        {(s["phase"], s["mode"]) for s in summary},
        key=lambda g: (g[0] != "counter", g[1] != "pooled"),
    )

    def draw(axes):  # type: ignore[no-untyped-def]
        width = 0.8 / len(WORKERS)
        for i, workers in enumerate(WORKERS):
            values = [
                next(
                    s["episodes_per_second_median"]
                    for s in summary
                    if (s["phase"], s["mode"]) == group and s["workers"] == workers
                )
                for group in groups
            ]
            positions = [g + (i - (len(WORKERS) - 1) / 2) * width for g in range(len(groups))]
            drawn = axes.bar(positions, values, width, label=f"{workers} worker(s)")
            axes.bar_label(drawn, fmt="%.0f", fontsize=7)
        axes.set_xticks(range(len(groups)), [f"{p}\n{m} client" for p, m in groups], fontsize=8)
        axes.set_ylabel("episodes / s")
        axes.set_title("Counter episodes per second, routed, load from another process")
        axes.legend(fontsize=8)

    _common.figure("throughput", draw)


if __name__ == "__main__":
    main()
