"""The ``frames`` hop: the ASGI request itself to the claimant's frames socket, no HTTP.

Each claimant gets a pool of idle persistent connections to its
`FrameListener`; a connection carries one request at a time. The request is
written in one go (``HEAD`` with the scope's fields and the headers the other
transports would send, then ``BODY``); the reply's ``START``, ``CHUNK`` and
``END`` frames become ``http.response.*`` messages as they arrive. Neither end
writes or parses HTTP. A connection goes back to the pool only after ``END``;
one that breaks or is abandoned mid-reply is closed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import cast

from starlette.types import Scope, Send

from gym_sessions.errors import BadGatewayError
from gym_sessions.routing.forwarder import (
    claimant_gone,
    forwarded_headers,
    reachable,
    reply_headers,
)
from gym_sessions.routing.frames_protocol import (
    BODY,
    CHUNK,
    END,
    HEAD,
    START,
    FrameError,
    FrameReader,
    decode_start,
    encode_head,
    frame,
    frame_header,
    frame_socket_path,
)
from gym_sessions.routing.runtime_dir import RuntimeDirectory

__all__ = ["FrameForwarder"]

_MAX_IDLE_PER_CLAIMANT = 64
_JOIN_BELOW = 64 * 1024
# Reply bytes read ahead of the caller's sends before the socket stops being read.
_PAUSE_ABOVE = 1024 * 1024
_RESUME_BELOW = 256 * 1024
_MAX_REPLY_FRAME = 1 << 62


class _ClaimantConnection(asyncio.Protocol):
    """One connection to a claimant's frames socket; frames queue until `next_frame` takes them."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._reader = FrameReader(_MAX_REPLY_FRAME)
        self._frames: deque[tuple[int, bytes]] = deque()
        self._queued = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._reader.feed(data)
        except FrameError:
            self.close()
            return
        if frames:
            self._frames.extend(frames)
            self._queued += sum(len(payload) for _, payload in frames)
            if self._queued > _PAUSE_ABOVE and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
            self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def next_frame(self) -> tuple[int, bytes]:
        """The next reply frame; `EOFError` if the claimant closed the connection first."""
        while not self._frames:
            if self.closed:
                raise EOFError("the claimant closed the connection")
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        kind, payload = self._frames.popleft()
        self._queued -= len(payload)
        if self._paused and self._queued < _RESUME_BELOW and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return kind, payload

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class FrameForwarder:
    """Forwards requests as frames over pooled persistent connections to frames sockets.

    Args:
        runtime_dir: The server's runtime directory, where the frames sockets live.
    """

    def __init__(self, runtime_dir: RuntimeDirectory) -> None:
        self.runtime_dir = runtime_dir
        self._idle: dict[str, deque[_ClaimantConnection]] = {}

    def socket_path(self, worker_id: str) -> str:
        """The frames socket of ``worker_id``."""
        return frame_socket_path(self.runtime_dir, worker_id)

    async def _connect(self, worker_id: str) -> _ClaimantConnection:
        idle = self._idle.get(worker_id)
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        try:
            _, connection = await loop.create_unix_connection(
                _ClaimantConnection, self.socket_path(worker_id)
            )
        except OSError as exc:  # refused, or the socket file is gone
            self._drop_pool(worker_id)
            raise claimant_gone(worker_id) from exc
        return connection

    def _release(self, worker_id: str, connection: _ClaimantConnection) -> None:
        idle = self._idle.setdefault(worker_id, deque())
        if len(idle) < _MAX_IDLE_PER_CLAIMANT:
            idle.append(connection)
        else:
            connection.close()

    def _drop_pool(self, worker_id: str) -> None:
        for connection in self._idle.pop(worker_id, ()):
            connection.close()

    async def forward(self, worker_id: str, scope: Scope, body: bytes, send: Send) -> None:
        """Send the request in ``scope`` with ``body`` to ``worker_id``; stream the reply back.

        Raises:
            SessionGoneError: the claimant's socket is gone or refuses connections.
            BadGatewayError: the claimant failed before replying for another reason.
        """
        headers = forwarded_headers(scope)
        headers.append((b"content-length", str(len(body)).encode()))
        request = frame(HEAD, encode_head(scope, headers)) + frame_header(BODY, len(body))
        connection = await self._connect(worker_id)
        try:
            if len(body) < _JOIN_BELOW:
                connection.write(request + body)  # one send for the usual small request
            else:
                connection.write(request)
                connection.write(body)  # no copy of a large body
            kind, payload = await connection.next_frame()
            if kind != START:
                raise FrameError(f"a reply began with a frame of kind {kind}")
            status, raw_headers = decode_start(payload)
        except (OSError, EOFError, FrameError) as exc:
            connection.close()
            raise await self._failure(worker_id, exc) from exc
        except BaseException:
            connection.close()
            raise
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": reply_headers(raw_headers),
                }
            )
            while True:
                kind, payload = await connection.next_frame()
                if kind == END:
                    await send({"type": "http.response.body", "body": payload, "more_body": False})
                    break
                if kind != CHUNK:
                    raise FrameError(f"a frame of kind {kind} inside a reply")
                await send({"type": "http.response.body", "body": payload, "more_body": True})
        except BaseException:
            # The reply is incomplete (claimant gone, or our caller left): this
            # connection is in an unknown state and is not reused.
            connection.close()
            raise
        self._release(worker_id, connection)

    async def _failure(self, worker_id: str, exc: BaseException) -> Exception:
        if not await reachable(self.socket_path(worker_id)):
            self._drop_pool(worker_id)
            return claimant_gone(worker_id)
        return BadGatewayError(f"forwarding to worker {worker_id} failed: {exc!r}")

    async def close(self) -> None:
        """Close every pooled connection."""
        for worker_id in list(self._idle):
            self._drop_pool(worker_id)
