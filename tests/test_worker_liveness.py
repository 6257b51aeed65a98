"""When a worker's process counts as gone (its sessions 410, its claims free to take over).

Real processes: a live one, a stopped one (SIGSTOP: alive, it resumes), and one
killed but not reaped (a zombie), which runs none of its code again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from gym_sessions.routing.worker_endpoints import UnixEndpoints
from gym_sessions.runtime_dir import RuntimeDirectory, worker_process_exists

from .polling import eventually


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


@pytest.fixture
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield child
    child.kill()
    child.wait()


async def test_a_connection_to_a_killed_worker_is_refused_though_its_socket_accepts(
    short_tmp, sleeper
):
    # A SIGKILLed worker's private socket may accept for a moment while the
    # kernel tears the process down; whatever is sent to it can never run, so
    # the hop is refused (the session may be restored) rather than sent into
    # it (a 502: "it may have run"). The socket here is the test's own, so it
    # goes on accepting for as long as the test wants.
    runtime = RuntimeDirectory.create(short_tmp)
    endpoints = UnixEndpoints(runtime)
    worker_id = _worker_id(sleeper.pid)
    accepted: list[asyncio.StreamWriter] = []
    listener = await asyncio.start_unix_server(
        lambda _reader, writer: accepted.append(writer), runtime.socket_path(worker_id)
    )
    try:
        _, writer = await endpoints.open(worker_id)  # alive: connected
        writer.close()
        os.kill(sleeper.pid, signal.SIGKILL)
        assert await eventually(lambda: not worker_process_exists(worker_id))
        await asyncio.sleep(0.05)  # let the listener take the first connection
        with pytest.raises(ConnectionRefusedError):
            await endpoints.open(worker_id)
        await asyncio.sleep(0.05)
        assert len(accepted) == 1  # the refused one never reached the socket
    finally:
        listener.close()
        for writer in accepted:
            writer.close()


def test_a_supervisors_runtime_directory_is_found_where_a_long_base_sent_it(tmp_path):
    # A base too long for socket paths sends the runtime directory to /tmp;
    # whoever looks for it by the supervisor's pid (`ServerProcess`) finds it there.
    long_base = tmp_path / ("x" * 60)
    long_base.mkdir()
    made = RuntimeDirectory.create(str(long_base))
    try:
        assert os.path.dirname(made.path) == "/tmp"
        assert RuntimeDirectory.of_supervisor(os.getpid(), str(long_base)) == [made.path]
        assert RuntimeDirectory.of_supervisor(os.getpid() + 1_000_000, str(long_base)) == []
    finally:
        shutil.rmtree(made.path)
