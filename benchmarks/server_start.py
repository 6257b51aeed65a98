"""How long a server takes to start and to stop, by worker count: what every e2e test pays.

Each round starts and stops a counter server (``envs.counter:CounterEnv``) at
each worker count, in rotated order: "start" is `start_server` until it is
ready (the listening line, ``/health``, every worker's private socket), "stop"
is `ServerProcess.stop` (SIGTERM until the supervisor exits). Also the import
time of one worker process (``python -c "import gym_sessions.server.worker"``,
a fresh interpreter each time). Medians over rounds.

    .venv/bin/python benchmarks/server_start.py [--rounds 5] [--workers 1 4]

Prints a Markdown table and writes server_start.json into --out DIR (default
benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time

import _common

from gym_sessions.server.process import start_server


def _import_seconds() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import gym_sessions.server.worker"], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    args = _common.parse_args(parser)
    print(_common.load_note())
    starts: dict[int, list[float]] = {n: [] for n in args.workers}
    stops: dict[int, list[float]] = {n: [] for n in args.workers}
    imports = []
    for r in range(args.rounds):
        imports.append(_import_seconds())
        order = args.workers[r % len(args.workers) :] + args.workers[: r % len(args.workers)]
        for n in order:
            began = time.perf_counter()
            server = start_server(
                "envs.counter:CounterEnv",
                workers=n,
                tmpdir=tempfile.mkdtemp(prefix="gs-", dir="/tmp"),
            )
            started = time.perf_counter()
            server.stop()
            starts[n].append(started - began)
            stops[n].append(time.perf_counter() - started)
    rows = [
        [n, f"{statistics.median(starts[n]):.2f} s", f"{statistics.median(stops[n]):.2f} s"]
        for n in args.workers
    ]
    print(_common.markdown_table(["workers", "start (median)", "stop (median)"], rows))
    print(f"\none worker process's imports: {statistics.median(imports):.2f} s (median)")
    path = _common.write_json(
        "server_start",
        {
            "machine": _common.machine(),
            "start_s": starts,
            "stop_s": stops,
            "worker_import_s": imports,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
