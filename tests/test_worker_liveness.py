"""When a worker's process counts as gone (its sessions 410, its claims free to take over).

Real processes: a live one, a stopped one (SIGSTOP: alive, it resumes), and one
killed but not reaped (a zombie), which runs none of its code again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from gym_sessions.runtime_dir import worker_process_exists


def _worker_id(pid: int) -> str:
    return f"{pid}-0123abcd"


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as file:
        stat = file.read()
    return stat[stat.rfind(b")") + 2 :].split()[0]


def test_a_live_or_stopped_process_exists_and_a_killed_one_does_not():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert worker_process_exists(_worker_id(child.pid))
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while _state(child.pid) != b"T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert worker_process_exists(_worker_id(child.pid))  # stopped, not gone
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while worker_process_exists(_worker_id(child.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # Gone although not reaped: kill(pid, 0) still succeeds on it.
        assert not worker_process_exists(_worker_id(child.pid))
        os.kill(child.pid, 0)
    finally:
        child.kill()
        child.wait()
    assert not worker_process_exists(_worker_id(child.pid))


def test_an_id_without_a_pid_is_never_taken_for_gone():
    assert worker_process_exists("in-process-worker")
