"""How long a server takes to start and to stop, by worker count: what every e2e test pays.

Each round starts and stops a counter server (``envs.counter:CounterEnv``) at
each worker count, in rotated order: "start" is `start_server` until it is
ready (the listening line, ``/health``, every worker's private socket), "stop"
is `ServerProcess.stop` (SIGTERM until the supervisor exits). Also the import
time of one worker process (``python -c "import gym_sessions.server.worker"``,
a fresh interpreter each time). Medians over rounds.

    .venv/bin/python benchmarks/server_start.py [--rounds 5] [--workers 1 4] [--baseline REV]

``--baseline REV`` starts the same servers from that commit's code too
(checked out in a temporary ``git worktree``), interleaved with this
checkout's in every round, and adds their start ratio (this / baseline).

Prints a Markdown table and writes server_start.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _common

from gym_sessions.server.process import start_server

TARGET = "envs.counter:CounterEnv"
HERE = "this checkout"


def _import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gym_sessions.server.worker"], check=True)
    return time.perf_counter() - start


def _starter(revision: _common.Revision | None) -> Callable[[int], Any]:
    if revision is None:
        return lambda n: start_server(
            TARGET, workers=n, tmpdir=tempfile.mkdtemp(prefix="gs-", dir="/tmp")
        )
    return lambda n: _common.start_revision_server(revision, TARGET, workers=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--baseline", metavar="REV", help="also start servers of this commit")
    args = _common.parse_args(parser)
    print(_common.load_note())
    with contextlib.ExitStack() as stack:
        starters = {HERE: _starter(None)}
        if args.baseline:
            (revision,) = stack.enter_context(_common.worktrees([args.baseline]))
            starters[args.baseline] = _starter(revision)
        classes = [(name, n) for n in args.workers for name in starters]
        starts: dict[tuple[str, int], list[float]] = {c: [] for c in classes}
        stops: dict[tuple[str, int], list[float]] = {c: [] for c in classes}
        imports = []
        for r in range(args.rounds):
            imports.append(_import_seconds())
            for name, n in classes[r % len(classes) :] + classes[: r % len(classes)]:
                began = time.perf_counter()
                server = starters[name](n)
                started = time.perf_counter()
                server.stop()
                starts[name, n].append(started - began)
                stops[name, n].append(time.perf_counter() - started)
    rows = []
    for name, n in classes:
        row = [name, n, f"{statistics.median(starts[name, n]):.2f} s"]
        row.append(f"{statistics.median(stops[name, n]):.2f} s")
        if args.baseline:
            ratios = [
                here / base
                for here, base in zip(starts[HERE, n], starts[args.baseline, n], strict=True)
            ]
            row.append(f"{statistics.median(ratios):.2f}" if name == HERE else "")
        rows.append(row)
    header = ["code", "workers", "start (median)", "stop (median)"]
    if args.baseline:
        header.append(f"start, this / {args.baseline} (median of rounds)")
    print(_common.markdown_table(header, rows))
    print(f"\none worker process's imports: {statistics.median(imports):.2f} s (median)")
    path = _common.write_json(
        "server_start",
        {
            "machine": _common.machine(),
            "start_s": {f"{name} {n}": v for (name, n), v in starts.items()},
            "stop_s": {f"{name} {n}": v for (name, n), v in stops.items()},
            "worker_import_s": imports,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
