"""The supervisor's readiness check of a new worker (`_WorkerProcess.wait_until_ready`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.supervisors.multiprocess import Process

from gym_sessions.transport.supervisor import _WorkerProcess

# Pings left unanswered while the worker "imports", as a spawned worker on a
# loaded machine leaves them (one a second).
_QUEUED_PINGS = 4


class _Idle(_WorkerProcess):
    """A live child process that serves nothing: the answers come from `_Pong`."""

    def target(self, sockets: Any = None) -> None:  # pragma: no cover (in the child)
        time.sleep(60)


class _Pong(threading.Thread):
    """uvicorn's side of the health check, for a worker slow to start answering.

    Waits until `_QUEUED_PINGS` pings are waiting, answers each "not started"
    (as a worker does once its answering thread runs, a moment before its
    server has started), then answers every later ping "started", counting them.
    """

    def __init__(self, process: Process) -> None:
        super().__init__(daemon=True)
        self.conn = process.child_conn
        self.answered_started = 0
        self.stop = threading.Event()

    def run(self) -> None:
        queued = 0
        while queued < _QUEUED_PINGS and not self.stop.is_set():
            if self.conn.poll(0.05):
                self.conn.recv()
                queued += 1
        for _ in range(queued):
            self.conn.send(False)
        while not self.stop.is_set():
            if self.conn.poll(0.05):
                self.conn.recv()
                self.answered_started += 1
                self.conn.send(True)


@pytest.fixture
def idle_process() -> Iterator[_Idle]:
    process = _Idle(uvicorn.Config(app="tests.unit.test_supervisor:nothing"), [])
    process.start()
    try:
        yield process
    finally:
        process.kill()
        process.join()


def test_a_worker_that_answers_late_is_seen_started_at_its_first_fresh_answer(idle_process):
    # uvicorn's check reads answers oldest first: it would need a ping per
    # queued answer (0.1 s apart) before it read "started".
    pong = _Pong(idle_process)
    pong.start()
    try:
        assert idle_process.wait_until_ready(30)
    finally:
        pong.stop.set()
        pong.join()
    assert pong.answered_started <= 2


def test_a_worker_that_exits_is_not_ready(idle_process):
    idle_process.kill()
    idle_process.process.join()
    started = time.monotonic()
    assert not idle_process.wait_until_ready(30)
    assert time.monotonic() - started < 5


def test_a_supervisor_that_stops_waits_for_no_worker(idle_process):
    stopping = threading.Event()
    stopping.set()
    assert not idle_process.wait_until_ready(30, stopping)
