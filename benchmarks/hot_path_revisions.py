"""The hot path before and after: ``/step`` local and forwarded at several commits, in one run.

Each commit (default: f720c20, the session's start; 2ccd0c5, ownership; HEAD,
the bounds of issue 14) is checked out in its own ``git worktree`` and served
from there (`_common.start_revision_server`, which checks that the supervisor
and every worker imported that worktree's ``gym_sessions``): a 4-worker
counter server per commit, all running side by side. On each, the
`routing_cost.Fleet` of that benchmark opens kept-alive connections until every
worker accepted two, starts one session per worker, and steps it

- over a connection the holding worker accepted: **local** (no hop), or
- over a connection another worker accepted: **forwarded** (one hop).

Classes run in interleaved rounds (a batch of each per round, the order
rotating), so the machine's load drifts over all of them alike; ratios are
medians of per-round ratios against the first commit. The server's CPU per
step (supervisor and workers, from ``/proc``, per batch) is steadier than wall
time on a shared machine. Every reply's count is checked.

    .venv/bin/python benchmarks/hot_path_revisions.py [--rounds 40] [--batch 100]
        [--commits f720c20 2ccd0c5 HEAD]

Prints Markdown tables; writes hot_path_revisions.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics

import _common
from _common import markdown_table, tree_cpu_seconds
from routing_cost import WORKERS, Fleet, round_order

TARGET = "envs.counter:CounterEnv"
KINDS = ("local", "forwarded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batch", type=int, default=100, help="steps per class per round")
    parser.add_argument("--warmup", type=int, default=200, help="unrecorded steps per class")
    parser.add_argument("--commits", nargs="+", default=["f720c20", "2ccd0c5", "HEAD"])
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()

    with contextlib.ExitStack() as stack:
        revisions = stack.enter_context(_common.worktrees(args.commits))
        fleets, servers, imported, healths = {}, {}, {}, {}
        for revision in revisions:
            server = stack.enter_context(
                _common.start_revision_server(revision, TARGET, workers=WORKERS)
            )
            servers[revision.label] = server
            imported[revision.label] = {str(pid): p for pid, p in server.imported.items()}
            healths[revision.label] = server.health()
            fleets[revision.label] = fleet = Fleet(server)
            stack.callback(fleet.close)

        def batch(label: str, kind: str):
            step = fleets[label].local if kind == "local" else fleets[label].forwarded
            pid = servers[label].process.pid

            def run(r: int, n: int, into: list[float]) -> float:
                before = tree_cpu_seconds(pid)
                step(r, n, into)
                return tree_cpu_seconds(pid) - before

            return run

        classes = [f"{r.label} {kind}" for r in revisions for kind in KINDS]
        batches = {f"{r.label} {k}": batch(r.label, k) for r in revisions for k in KINDS}
        for r, kind in itertools.product(range(WORKERS), classes):
            batches[kind](r, args.warmup // WORKERS, [])
        per_round: dict[str, list[list[float]]] = {kind: [] for kind in classes}
        cpu: dict[str, float] = dict.fromkeys(classes, 0.0)
        for r in range(args.rounds):
            for kind in round_order(classes, r):
                samples: list[float] = []
                cpu[kind] += batches[kind](r, args.batch, samples)
                per_round[kind].append(samples)
        for fleet in fleets.values():
            fleet.check()

    report = summarize(per_round, cpu, revisions, args, machine)
    report["imported"] = imported
    report["health_at_start"] = healths
    print_report(report)
    path = _common.write_json("hot_path_revisions", report)
    _common.latency_cdf(
        "hot_path_revisions", per_round, "/step by commit: local and forwarded", legend_size=7
    )
    print(f"\nwrote {path} and hot_path_revisions.png")


def summarize(per_round, cpu, revisions, args, machine) -> dict:
    classes = list(per_round)
    base = revisions[0].label
    pooled = {k: _common.summary([x for b in per_round[k] for x in b]) for k in classes}
    p50s = {k: [_common.percentile(b, 50) for b in per_round[k]] for k in classes}
    p90s = {k: [_common.percentile(b, 90) for b in per_round[k]] for k in classes}
    ratios, hops = {}, {}
    for revision in revisions:
        label = revision.label
        for kind in KINDS:
            key, ref = f"{label} {kind}", f"{base} {kind}"
            per_round = [a / b for a, b in zip(p50s[key], p50s[ref], strict=True)]
            ratios[key] = {
                "p50": _common.median_ratio(p50s[key], p50s[ref]),
                "p90": _common.median_ratio(p90s[key], p90s[ref]),
                "p50_quartiles_of_rounds": [
                    _common.percentile(per_round, 25),
                    _common.percentile(per_round, 75),
                ],
            }
        hops[label] = statistics.median(
            f - lo for f, lo in zip(p50s[f"{label} forwarded"], p50s[f"{label} local"], strict=True)
        )
    steps = args.rounds * args.batch
    return {
        "machine": machine,
        "commits": {r.label: r.commit for r in revisions},
        "baseline": base,
        "rounds": args.rounds,
        "batch": args.batch,
        "unit": "ms per request, client-side wall time of one sequential /step",
        "pooled": pooled,
        "per_round_p50": p50s,
        "per_round_p90": p90s,
        f"over_{base}_median_of_rounds": ratios,
        "hop_cost_p50_ms_median_of_rounds": hops,
        "server_cpu_us_per_step": {k: cpu[k] / steps * 1e6 for k in classes},
    }


def print_report(report: dict) -> None:
    base = report["baseline"]
    ratios = report[f"over_{base}_median_of_rounds"]
    print(
        f"\n/step, one kept-alive connection, sequential; {report['rounds']} interleaved rounds x "
        f"{report['batch']} steps per class; 4 workers per commit\n"
    )
    rows = []
    for kind, s in report["pooled"].items():
        label = kind.rsplit(" ", 1)[0]
        q = ratios[kind]["p50_quartiles_of_rounds"]
        rows.append(
            [
                f"{kind} ({report['commits'][label][:7]})",
                f"{s['p50']:.3f}",
                f"{s['p90']:.3f}",
                f"{s['p99']:.3f}",
                f"{ratios[kind]['p50']:.2f}x ({q[0]:.2f}-{q[1]:.2f})",
                f"{ratios[kind]['p90']:.2f}x",
                f"{report['server_cpu_us_per_step'][kind]:.0f}",
            ]
        )
    headers = [
        "class",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        f"p50 / {base} (quartiles of rounds)",
        f"p90 / {base}",
        "server CPU us/step",
    ]
    print(markdown_table(headers, rows))
    print()
    hop_rows = [
        [label, f"{ms:.3f}"] for label, ms in report["hop_cost_p50_ms_median_of_rounds"].items()
    ]
    print(markdown_table(["commit", "hop cost: forwarded - local, p50 ms"], hop_rows))


if __name__ == "__main__":
    main()
