"""The shipped hop: HTTP/1.1 by hand on persistent Unix-socket connections.

Each holder gets a pool of idle kept-alive connections. A request is written
in one go (request line, headers, ``content-length``, body); the reply is
parsed with httptools (uvicorn's own parser) and streamed to the caller as it
arrives. A connection goes back to the pool only after a complete reply that
allows keep-alive; one that breaks mid-reply is closed.

Compared with an aiohttp client this skips building request and response
objects per call, which is most of the hop's CPU on a trivial request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import httptools
from starlette.types import Scope, Send

from gym_sessions.errors import (
    BadGatewayError,
    OverloadedError,
    exception_text,
    out_of_resources,
)
from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.routing.forwarder import HolderRefusedError, holder_gone, holder_refused
from gym_sessions.routing.hop_headers import (
    forwarded_headers,
    hop_marks,
    reply_headers,
    request_target,
)
from gym_sessions.routing.worker_endpoints import WorkerEndpoints

__all__ = ["StreamForwarder"]

_READ_SIZE = 256 * 1024
_MAX_IDLE_PER_HOLDER = 64
# A pooled connection unused this long is closed (well before the private
# listener's own keep-alive would close it from its side).
_IDLE_CLOSE_SECONDS = 15.0
_BROKEN = (OSError, EOFError, httptools.HttpParserError)


class _ClosedUnanswered(EOFError):
    """The holder closed the connection before a single byte of its reply came."""


_JOIN_BELOW = 64 * 1024


class _Reply:
    """httptools callbacks collecting one reply: headers first, then body chunks."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.keep_alive = False
        self.parser: Any = None
        self.complete = False
        self.chunks: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        # httptools answers this only while the message is being parsed.
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True

    def take_chunks(self) -> bytes:
        chunks, self.chunks = self.chunks, []
        return b"".join(chunks)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.idle_timer: asyncio.TimerHandle | None = None

    def cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def close(self) -> None:
        self.cancel_idle_timer()
        self.writer.close()


class StreamForwarder:
    """Forwards requests over pooled persistent connections to private sockets.

    Args:
        endpoints: Where other workers' private listeners are.
        signer: Signs each request (private listeners on TCP); ``None`` on Unix sockets.
    """

    def __init__(self, endpoints: WorkerEndpoints, signer: ForwardSigner | None = None) -> None:
        self.endpoints = endpoints
        self.signer = signer
        self._idle: dict[str, deque[_Connection]] = {}

    async def _connect(self, worker_id: str) -> tuple[_Connection, bool]:
        idle = self._idle.get(worker_id)
        while idle:
            connection = idle.pop()
            connection.cancel_idle_timer()
            if not connection.reader.at_eof() and not connection.writer.is_closing():
                return connection, True
            connection.close()
        try:
            reader, writer = await self.endpoints.open(worker_id)
        except TimeoutError as exc:  # no answer: slow or unreachable, not known gone
            raise BadGatewayError(f"worker {worker_id} did not accept a connection") from exc
        except OSError as exc:  # refused, gone, or unregistered
            if out_of_resources(exc):  # our shortage, not the holder's death
                raise OverloadedError(
                    f"this worker is short of resources to reach worker {worker_id}: {exc.strerror}"
                ) from exc
            self._drop_pool(worker_id)
            raise holder_refused(worker_id) from exc
        return _Connection(reader, writer), False

    def _release(self, worker_id: str, connection: _Connection) -> None:
        idle = self._idle.setdefault(worker_id, deque())
        if len(idle) < _MAX_IDLE_PER_HOLDER:
            idle.append(connection)
            # After a burst the pool shrinks back: descriptors return to their baseline.
            loop = asyncio.get_running_loop()
            connection.idle_timer = loop.call_later(
                _IDLE_CLOSE_SECONDS, self._close_idle, worker_id, connection
            )
        else:
            connection.close()

    def _close_idle(self, worker_id: str, connection: _Connection) -> None:
        idle = self._idle.get(worker_id)
        if idle is not None and connection in idle:
            idle.remove(connection)
            if not idle:
                del self._idle[worker_id]
        connection.close()

    def _drop_pool(self, worker_id: str) -> None:
        for connection in self._idle.pop(worker_id, ()):
            connection.close()

    async def forward(self, worker_id: str, scope: Scope, body: bytes, send: Send) -> None:
        """Send the request in ``scope`` with ``body`` to ``worker_id``; stream the reply back.

        Raises:
            SessionGoneError: the holder's socket is gone or refuses connections.
            BadGatewayError: the holder failed before replying for another reason.
        """
        signature = self.signer.header(scope, body, worker_id) if self.signer else None
        head = _request_head(scope, len(body), signature)
        connection, reused = await self._connect(worker_id)
        try:
            reply, parser = await self._exchange(connection, head, body)
        except _BROKEN as exc:
            connection.close()
            if (
                reused
                and isinstance(exc, _ClosedUnanswered)
                and await self.endpoints.reachable(worker_id)
            ):
                # A pooled connection the holder closed while idle: nothing was
                # read from it, so the request never ran. Try once more, afresh.
                # (Once any byte of a reply came, the request may have run: a
                # resend could run a step twice, so that is a 502 instead.)
                try:
                    connection, _ = await self._connect(worker_id)
                except HolderRefusedError as refused:
                    # It accepted our probe, then refused: it died just now, and the
                    # close we took for an idle one may have come from its exit after
                    # it ran the request. Gone, never "refused": a refusal lets a
                    # durable session be restored elsewhere and this request run again.
                    raise holder_gone(worker_id) from refused
                try:
                    reply, parser = await self._exchange(connection, head, body)
                except _BROKEN as retry_exc:
                    connection.close()
                    raise await self._failure(worker_id, retry_exc) from retry_exc
            else:
                raise await self._failure(worker_id, exc) from exc
        except BaseException:
            connection.close()  # cancelled mid-exchange: the connection's state is unknown
            raise
        if 100 <= parser.get_status_code() < 200:
            # Interim replies cannot come (Expect is not forwarded); never pool after one.
            connection.close()
            raise BadGatewayError(f"worker {worker_id} sent an interim reply")
        await self._stream_reply(worker_id, connection, reply, parser, send, scope["method"])

    async def _exchange(
        self, connection: _Connection, head: bytes, body: bytes
    ) -> tuple[_Reply, Any]:
        """Write the request and read until the reply's headers are in."""
        if len(body) < _JOIN_BELOW:
            connection.writer.write(head + body)  # one send for the usual small request
        else:
            connection.writer.write(head)
            connection.writer.write(body)  # no copy of a large body
        await connection.writer.drain()
        reply = _Reply()
        parser = reply.parser = httptools.HttpResponseParser(reply)
        answered = False
        while not reply.headers_done:
            data = await connection.reader.read(_READ_SIZE)
            if not data:
                if answered:
                    raise EOFError("the holder closed the connection mid-reply")
                raise _ClosedUnanswered("the holder closed the connection before replying")
            answered = True
            parser.feed_data(data)
        return reply, parser

    async def _stream_reply(
        self,
        worker_id: str,
        connection: _Connection,
        reply: _Reply,
        parser: Any,
        send: Send,
        method: str,
    ) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": parser.get_status_code(),
                "headers": reply_headers(reply.headers),
            }
        )
        # A reply to HEAD has no body, whatever its content-length says; the
        # parser does not know the method, so it would wait for one.
        reply.complete = reply.complete or method == "HEAD"
        try:
            while True:
                chunk = reply.take_chunks()
                if reply.complete:
                    await send({"type": "http.response.body", "body": chunk, "more_body": False})
                    break
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                data = await connection.reader.read(_READ_SIZE)
                if not data:
                    raise EOFError("the holder closed the connection mid-reply")
                parser.feed_data(data)
        except BaseException:
            # The reply is incomplete (holder gone, or our client left): this
            # connection is in an unknown state and is not reused.
            connection.close()
            raise
        if reply.keep_alive:
            self._release(worker_id, connection)
        else:
            connection.close()

    async def _failure(self, worker_id: str, exc: BaseException) -> Exception:
        if not await self.endpoints.reachable(worker_id):
            self._drop_pool(worker_id)
            return holder_gone(worker_id)
        return BadGatewayError(f"forwarding to worker {worker_id} failed: {exception_text(exc)}")

    async def close(self) -> None:
        """Close every pooled connection."""
        for worker_id in list(self._idle):
            self._drop_pool(worker_id)


def _request_head(scope: Scope, body_length: int, signature: tuple[bytes, bytes] | None) -> bytes:
    lines = [
        scope["method"].encode("ascii"),
        b" ",
        request_target(scope),
        b" HTTP/1.1\r\n",
    ]
    for name, value in [*forwarded_headers(scope), *hop_marks(scope)]:
        lines += [name, b": ", value, b"\r\n"]
    if signature is not None:
        lines += [signature[0], b": ", signature[1], b"\r\n"]
    lines += [b"content-length: ", str(body_length).encode(), b"\r\n\r\n"]
    return b"".join(lines)
