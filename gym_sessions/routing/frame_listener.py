"""Each worker's frames socket: requests from other workers as ASGI frames, no HTTP.

With ``forward_transport="frames"`` every routed worker listens on
``<runtime dir>/workers/<id>.asgi`` (mode 0600) beside its HTTP private
socket. A connection carries one request at a time: a
``HEAD`` and a ``BODY`` frame (`gym_sessions.routing.frames_protocol`) become
an ASGI http scope, marked as arrived over a private socket so the router
serves it here, and the app's ``http.response.*`` messages go back as
``START``, ``CHUNK`` and ``END`` frames. The next request may come once
``END`` is written, even while the app still runs. The start waits for the
first body message of the same step, so a plain reply leaves in one write.

As under uvicorn (ASGI spec 2.3): ``receive`` gives the body once, then waits
for the connection to close (``http.disconnect``); after a disconnect ``send``
does nothing; an app that fails before its reply starts gets a 500, after it
the connection closes, so the forwarder sees a reply cut short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any, cast

from starlette.types import ASGIApp, Message, Scope

from gym_sessions.routing.frames_protocol import (
    BODY,
    CHUNK,
    END,
    HEAD,
    START,
    FrameError,
    FrameReader,
    decode_head,
    encode_start,
    frame,
    frame_header,
)
from gym_sessions.routing.private_listener import PRIVATE_SCOPE_KEY

__all__ = ["FrameListener"]

logger = logging.getLogger("gym_sessions.routing")

_JOIN_BELOW = 64 * 1024
_HEAD_ALLOWANCE = 1024 * 1024  # scope fields and headers; the router caps headers lower
_INTERNAL_ERROR = (
    500,
    [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", b"21")],
    b"Internal Server Error",
)


class _Exchange:
    """One request on a connection: the ASGI ``receive`` and ``send`` of its app call."""

    def __init__(self, connection: _ListenerConnection, body: bytes) -> None:
        self.connection = connection
        self.body: bytes | None = body
        self.started = False
        self.complete = False
        self._start: bytes | None = None  # encoded, not yet written
        self._ended: asyncio.Event | None = None  # made only when someone waits for it

    async def receive(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        if not self.complete and not self.connection.closed:
            if self._ended is None:
                self._ended = asyncio.Event()
            await self._ended.wait()
        return {"type": "http.disconnect"}

    def end(self) -> None:
        """The reply is complete or the connection closed: waiting receives return."""
        if self._ended is not None:
            self._ended.set()

    async def send(self, message: Message) -> None:
        connection = self.connection
        if not connection.writable.is_set():
            await connection.writable.wait()
        if connection.closed:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            self.started = True
            self._start = frame(START, encode_start(message["status"], message.get("headers", ())))
            # Written with the first body message when that comes in this same step.
            asyncio.get_running_loop().call_soon(self.flush_start)
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r} after the reply")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if more and not body:
            return
        head = frame_header(CHUNK if more else END, len(body))
        if self._start is not None:
            head = self._start + head
            self._start = None
        if len(body) < _JOIN_BELOW:
            connection.write(head + body)
        else:
            connection.write(head)
            connection.write(body)
        if not more:
            self.complete = True
            self.end()

    def flush_start(self) -> None:
        if self._start is not None and not self.connection.closed:
            self.connection.write(self._start)
        self._start = None


class _ListenerConnection(asyncio.Protocol):
    """One forwarder connection; runs its requests one at a time."""

    def __init__(self, listener: FrameListener) -> None:
        self.listener = listener
        self.transport: asyncio.Transport | None = None
        self.reader = FrameReader(max(listener.max_body_bytes, _HEAD_ALLOWANCE))
        self.head: bytes | None = None
        self.exchange: _Exchange | None = None
        self.closed = False
        self.writable = asyncio.Event()
        self.writable.set()
        self.close_when_done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        self.listener.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        if self.exchange is not None:
            self.exchange.end()
        self.listener.connections.discard(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        try:
            frames = self.reader.feed(data)
            for kind, payload in frames:
                self._on_frame(kind, payload)
        except FrameError as exc:
            logger.warning("closing a frames connection: %s", exc)
            self.close()

    def _on_frame(self, kind: int, payload: bytes) -> None:
        # The next request may come once the reply is complete, even while the
        # app still runs (background tasks after the reply).
        if self.exchange is not None and not self.exchange.complete:
            raise FrameError("a request arrived before the previous reply ended")
        if kind == HEAD and self.head is None:
            self.head = payload
        elif kind == BODY and self.head is not None:
            scope = decode_head(self.head)
            self.head = None
            scope[PRIVATE_SCOPE_KEY] = True
            self.exchange = _Exchange(self, payload)
            task = asyncio.get_running_loop().create_task(self._run(scope, self.exchange))
            self.listener.tasks.add(task)
            task.add_done_callback(self.listener.tasks.discard)
        else:
            raise FrameError(f"unexpected frame of kind {kind}")

    async def _run(self, scope: Scope, exchange: _Exchange) -> None:
        try:
            await self.listener.app(scope, exchange.receive, exchange.send)
        except Exception:
            logger.exception("exception in ASGI application (frames socket)")
            if not exchange.started:
                await _send_internal_error(exchange)
        else:
            if not exchange.started:
                logger.error("ASGI callable returned without starting a reply")
                await _send_internal_error(exchange)
        finally:
            exchange.end()
            if self.exchange is exchange:
                self.exchange = None
            if not exchange.complete:
                exchange.flush_start()
                self.close()  # the reply is cut short, and the forwarder sees it
            elif self.close_when_done and self.exchange is None:
                self.close()


async def _send_internal_error(exchange: _Exchange) -> None:
    status, headers, body = _INTERNAL_ERROR
    await exchange.send({"type": "http.response.start", "status": status, "headers": headers})
    await exchange.send({"type": "http.response.body", "body": body, "more_body": False})


class FrameListener:
    """Serves ``app`` over frames on the Unix socket at ``path`` until `stop`.

    Args:
        app: The worker's ASGI app (the same object the public server runs).
        path: Socket path (`frames_protocol.frame_socket_path`).
        max_body_bytes: Largest request body a frame may carry.
    """

    def __init__(self, app: ASGIApp, path: str, *, max_body_bytes: int) -> None:
        self.app = app
        self.path = path
        self.max_body_bytes = max_body_bytes
        self.connections: set[_ListenerConnection] = set()
        self.tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        """Start listening."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(
            lambda: _ListenerConnection(self), path=self.path
        )
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Stop listening, let open requests finish briefly, and remove the socket."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self.connections):
            if connection.exchange is None or connection.exchange.complete:
                connection.close()
            else:
                connection.close_when_done = True
        for _ in range(50):
            if not self.tasks:
                break
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            connection.close()
        self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
