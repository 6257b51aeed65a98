"""Keep every core busy from other processes while the stress checks run.

    with cpu_hog():            # one busy-looping process per core, bounded in time
        rows = run_suite(SMALL)

    .venv/bin/python -m tests.stress.hog --seconds 60     # just the hog, for a manual run

Each hog is a separate ``python -c`` process that spins until its own deadline,
so a hog outlives nothing even if its parent is killed: it exits by itself
after ``seconds``. The context manager kills its hogs by PID on exit.
The opt-in test mode is ``GYM_SESSIONS_STRESS_HOG=1`` (tests/e2e/test_stress_subset.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

__all__ = ["HOG_ENV", "cpu_hog", "hog_requested"]

HOG_ENV = "GYM_SESSIONS_STRESS_HOG"
# Spins until its deadline; checks the clock only every 100,000 iterations.
_SPIN = (
    "import time\n"
    "deadline = time.monotonic() + {seconds}\n"
    "while time.monotonic() < deadline:\n"
    "    for _ in range(100_000):\n"
    "        pass\n"
)


def hog_requested() -> bool:
    """Whether ``GYM_SESSIONS_STRESS_HOG=1`` asks for the stress checks under a CPU hog."""
    return os.environ.get(HOG_ENV) == "1"


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_hog(processes: int | None = None, seconds: float = 900.0) -> Iterator[list[int]]:
    """Run ``processes`` (default: one per core) busy loops for at most ``seconds``.

    Yields their PIDs; on exit kills them (by PID) and reports each one's CPU
    seconds on stderr, so a run can show the hogs really competed.
    """
    count = processes or os.cpu_count() or 1
    hogs = [
        subprocess.Popen(
            [sys.executable, "-c", _SPIN.format(seconds=float(seconds))],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        for _ in range(count)
    ]
    started = time.monotonic()
    try:
        yield [hog.pid for hog in hogs]
    finally:
        used = []
        for hog in hogs:
            with contextlib.suppress(OSError):
                used.append(_cpu_seconds(hog.pid))
            hog.kill()
            hog.wait(10)
        elapsed = time.monotonic() - started
        print(
            f"cpu hog: {count} busy loops for {elapsed:.1f} s used "
            f"{sum(used):.1f} CPU s ({', '.join(f'{u:.1f}' for u in used)})",
            file=sys.stderr,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description="busy-loop every core for a while")
    parser.add_argument("--processes", type=int, default=None, help="default: one per core")
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with cpu_hog(args.processes, args.seconds) as pids:
        print(f"hogs {pids} for {args.seconds:.0f} s", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(args.seconds)


if __name__ == "__main__":
    main()
