"""`DisconnectWatch` on a scripted ASGI channel: what a disconnect cancels, and what it does not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gym_sessions.routing.disconnect import DisconnectWatch


class Channel:
    """The ASGI receive of a request whose body was read: blocks until `leave`."""

    def __init__(self) -> None:
        self._left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self._left.set()


async def _sent(message: dict[str, Any]) -> None:
    pass


async def test_cancellable_work_is_cancelled_when_the_client_leaves():
    channel = Channel()
    watch = DisconnectWatch(channel.receive)
    entered, cancelled = asyncio.Event(), asyncio.Event()

    async def work() -> None:
        entered.set()
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    running = asyncio.create_task(watch.run(work(), cancellable=True))
    await entered.wait()
    channel.leave()
    await asyncio.wait_for(running, 2)  # ends quietly: nobody is left to answer
    assert cancelled.is_set() and watch.cancelled
    watch.close()


async def test_work_that_runs_to_completion_finishes_and_sees_the_disconnect():
    channel = Channel()
    watch = DisconnectWatch(channel.receive)
    seen: list[str] = []

    async def work() -> None:
        seen.append((await watch.receive())["type"])
        await asyncio.sleep(0.05)
        seen.append("finished")

    running = asyncio.create_task(watch.run(work(), cancellable=False))
    await asyncio.sleep(0)
    channel.leave()
    await asyncio.wait_for(running, 2)
    assert seen == ["http.disconnect", "finished"] and not watch.cancelled
    watch.close()


async def test_nothing_is_cancelled_once_the_reply_started():
    channel = Channel()
    watch = DisconnectWatch(channel.receive)
    send = watch.watching(_sent)

    async def work() -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        channel.leave()  # uvicorn says so once a reply is complete, too
        await asyncio.sleep(0.05)

    await asyncio.wait_for(watch.run(work(), cancellable=True), 2)
    assert not watch.cancelled
    watch.close()


async def test_the_callers_own_cancellation_propagates():
    channel = Channel()
    watch = DisconnectWatch(channel.receive)
    inner_cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            inner_cancelled.set()
            raise

    running = asyncio.create_task(watch.run(work(), cancellable=True))
    await asyncio.sleep(0.01)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert inner_cancelled.is_set() and not watch.cancelled
    watch.close()


async def test_errors_of_the_work_propagate_and_a_late_receive_ends():
    channel = Channel()
    watch = DisconnectWatch(channel.receive)

    async def work() -> None:
        raise ValueError("the handler failed")

    with pytest.raises(ValueError, match="the handler failed"):
        await watch.run(work(), cancellable=True)
    watch.close()
    assert (await asyncio.wait_for(watch.receive(), 1))["type"] == "http.disconnect"
