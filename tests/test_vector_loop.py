"""`_VectorLoop`: the vector env's event loop, run by the caller's thread or its own."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gym_sessions.client.vector_env import _VectorLoop


def test_runs_in_the_calling_thread_and_keeps_one_loop():
    runner = _VectorLoop()
    threads = threading.active_count()

    async def where() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
        return asyncio.get_running_loop(), threading.current_thread()

    assert runner.run(where()) == (runner.loop, threading.current_thread())
    assert runner.run(where())[0] is runner.loop
    assert threading.active_count() == threads
    runner.stop()
    assert runner.loop.is_closed()


def test_an_interrupted_run_leaves_no_request_running():
    runner = _VectorLoop()
    cancelled: list[str] = []

    async def request() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append("request")
            raise

    async def interrupted() -> None:
        asyncio.get_running_loop().call_later(0.05, _interrupt)
        await asyncio.gather(request(), request())

    with pytest.raises(KeyboardInterrupt):
        runner.run(interrupted())
    assert cancelled == ["request", "request"]
    assert not [t for t in asyncio.all_tasks(runner.loop) if not t.done()]

    async def answer() -> int:
        return 42

    assert runner.run(answer()) == 42  # the loop is usable again
    runner.stop()


def _interrupt() -> None:
    raise KeyboardInterrupt


def test_inside_a_running_loop_it_moves_to_a_thread_for_good():
    runner = _VectorLoop()

    async def thread_name() -> str:
        return threading.current_thread().name

    async def from_a_loop() -> str:
        return runner.run(thread_name())

    assert asyncio.run(from_a_loop()) == "gym-sessions-vector-loop"
    assert runner.run(thread_name()) == "gym-sessions-vector-loop"  # no way back
    runner.stop()
    assert runner.loop.is_closed()


def test_waiting_for_itself_from_inside_is_refused():
    runner = _VectorLoop()

    async def inner() -> None:
        pass

    async def outer() -> None:
        with pytest.raises(RuntimeError, match="its own event loop"):
            runner.run(inner())

    runner.run(outer())
    runner.stop()
