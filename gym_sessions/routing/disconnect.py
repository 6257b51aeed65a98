"""`DisconnectWatch`: stop a request's work when its client goes away.

NeMo Gym's servers cancel a handler whose client disconnected, and its clients
rely on it: a rollout that gives up on ``/run`` expects the agent to stop
stepping and to close what it opened. Once the router has read a request's
body, a watch is the only reader of the ASGI ``receive``. When the client
disconnects before the reply starts, the work it guards is cancelled at its
next ``await``:

- a forward (the accepting worker's hop): the forwarder closes its connection
  to the holder, whose own watch then sees the disconnect, so the
  cancellation reaches the handler on the holder;
- a handler whose route may be cut short (tools, ``/run``, ...).

Routes that change a session's lifetime (starts, closes, ``/verify``) are not
cancelled: they run to their end and their reply is dropped, so a retry finds
the session as the finished request left it. A cancellation never lands
inside the router's claim bookkeeping, only inside the guarded work, and once
the reply has started nothing is cancelled any more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from starlette.types import Message, Receive, Send

__all__ = ["DisconnectWatch"]

_DISCONNECT: Message = {"type": "http.disconnect"}


class DisconnectWatch:
    """Watches one request's connection from the end of its body to the end of the request.

    Args:
        receive: The request's ASGI ``receive``; its body must be read already.
        task: The task `run` will be awaited in, if known (the router's: each
            lookup of the running task or loop costs a ``getpid()``); else
            `run` looks its task up.
    """

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None = None) -> None:
        self._owner = task
        self._receive = receive
        self._gone = asyncio.Event()
        self._replying = False
        self._task: asyncio.Task[Any] | None = None
        self._cancellable = False
        #: The client disconnected and the guarded work was cancelled for it.
        self.cancelled = False
        # The listener task starts on the loop's next turn, which comes only if
        # the request's task suspends: that is when a disconnect could first be
        # seen and acted on. A request served without suspending (most tool
        # calls) costs one callback handle instead of a task started and cancelled.
        self._listener: asyncio.Task[None] | None = None
        loop = task.get_loop() if task is not None else asyncio.get_running_loop()
        self._start = loop.call_soon(self._start_listening)

    def _start_listening(self) -> None:
        self._listener = asyncio.ensure_future(self._listen())

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass  # the body was read whole: nothing else can come
        # uvicorn also says http.disconnect once a reply is complete; by then
        # `_replying` is set and nothing is cancelled.
        self._gone.set()
        if self._task is not None and self._cancellable and not self._replying:
            # The task is suspended, and only inside `run`'s await of the work
            # (`_task` is set for no longer): the cancellation lands in the work.
            self.cancelled = True
            self._task.cancel()

    async def receive(self) -> Message:
        """The app's ``receive`` after the body: ``http.disconnect`` once the client left."""
        await self._gone.wait()
        return _DISCONNECT

    def watching(self, send: Send) -> Send:
        """``send``, noting when the reply starts (from then on nothing is cancelled)."""

        async def send_watched(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._replying = True
            await send(message)

        return send_watched

    def reply_started(self) -> None:
        """The reply starts, seen by the caller's own ``send`` wrapper: nothing is cancelled now."""
        self._replying = True

    async def run(self, work: Coroutine[Any, Any, None], *, cancellable: bool) -> None:
        """Run ``work`` in the watch's task; cancel it if the client leaves first and cancellable.

        A cancellation for the disconnect ends here (the client is not there to
        be answered); one of anyone else propagates. The work runs in the
        caller's task, not a task of its own: a task more per request would
        cost as much again as the watch itself.
        """
        if cancellable and self._gone.is_set():
            work.close()  # the client left while the router decided: nothing to do
            self.cancelled = True
            return
        task = self._owner or asyncio.current_task()
        assert task is not None
        self._task, self._cancellable = task, cancellable
        try:
            await work
        except asyncio.CancelledError:
            # `uncancel` takes back our request; more left means someone else's too.
            if not self.cancelled or task.uncancel() > 0:
                raise
        else:
            if self.cancelled:
                task.uncancel()  # the work caught our cancellation and finished
        finally:
            self._task = None

    def close(self) -> None:
        """The request ended: stop listening; a late ``receive`` says disconnected."""
        self._start.cancel()
        if self._listener is not None:
            self._listener.cancel()
        self._gone.set()
