"""No orphans: a SIGKILLed supervisor takes every process it started with it.

Workers, multiprocessing's resource tracker and anything they started must be
gone within 2 s of the supervisor's SIGKILL, even with the machine's cores
busy (two busy-loop processes beside the server, as the probe of issue 33
ran it: there, workers used to serve on for 10-30 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from gym_sessions.server.process import ServerProcess, live_parents, start_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COUNTER = "envs.counter:CounterEnv"
#: Supervisor kills in the test; ``GS_ORPHAN_ROUNDS`` lowers it for a quick look.
ROUNDS = int(os.environ.get("GS_ORPHAN_ROUNDS", "50"))
#: The bound of issue 33, from the kill to the last descendant gone.
BOUND_SECONDS = 2.0
_BUSY_LOOP = "import time\nend = time.monotonic() + 1800\nwhile time.monotonic() < end: pass\n"


_parents = live_parents


def _descendants(root: int) -> set[int]:
    parents = _parents()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int]) -> set[int]:
    live = set(_parents())
    return pids & live


@pytest.fixture
def busy_machine() -> Iterator[None]:
    """Two busy-loop processes (bounded to 30 min), stopped by the test's teardown."""
    loops = [subprocess.Popen([sys.executable, "-c", _BUSY_LOOP]) for _ in range(2)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait(10)


#: Servers started at once: their starts overlap, each is still killed and
#: watched alone (the kill, then its own 2 s bound).
BATCH = 5


def _kill_and_watch(server: ServerProcess) -> set[int]:
    """SIGKILL the supervisor; the descendants still alive ``BOUND_SECONDS`` later."""
    descendants = _descendants(server.process.pid)
    assert len(server.worker_pids()) == 4
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(10)
    deadline = time.monotonic() + BOUND_SECONDS
    while _alive(descendants) and time.monotonic() < deadline:
        time.sleep(0.02)
    left = _alive(descendants)
    for pid in left:  # never leave them running past the test
        os.kill(pid, signal.SIGKILL)
    return left


def test_no_supervisor_sigkill_leaves_a_process_alive_on_a_busy_machine(busy_machine, short_tmp):
    survivors: list[tuple[int, set[int]]] = []
    with ThreadPoolExecutor(BATCH) as pool:
        for first in range(0, ROUNDS, BATCH):
            rounds = range(first, min(first + BATCH, ROUNDS))
            starts = {
                round_: pool.submit(
                    start_server,
                    COUNTER,
                    workers=4,
                    tmpdir=os.path.join(short_tmp, f"r{round_}"),
                    ready_timeout=120,
                )
                for round_ in rounds
            }
            servers = {}
            try:
                for round_, start in starts.items():
                    servers[round_] = start.result()
                for round_, server in servers.items():
                    if left := _kill_and_watch(server):
                        survivors.append((round_, left))
            finally:
                for start in starts.values():  # those whose start failed are stopped too
                    if start.exception() is None:
                        start.result().stop()
    assert not survivors, f"{len(survivors)} of {ROUNDS} kills left processes alive: {survivors}"
