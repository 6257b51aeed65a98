"""One kept-alive HTTP/1.1 client connection on asyncio, for `AsyncHTTPClient`'s own sessions.

A session's requests go one after another over one connection, so the client
needs no pool, no cookie jar and no redirects: `Http11Connection` writes a
request head built in one pass (fixed ``Host`` line, the exchange's headers,
``Content-Length``) and the body in one write, and reads the reply with a
small parser (status line, headers, a ``Content-Length`` or chunked body).
Against aiohttp this cut the client's share of a ``/step`` (see
benchmarks/openenv_peer.py).

It reports failures as `TransportFailure` (``UNREACHABLE``: no connection;
``LOST``: it broke after the request went out; ``TIMEOUT``: no reply in
time), and the connection is dropped after any failure, after a reply with
``Connection: close`` and after `IDLE_SECONDS` unused, so the next request
opens a new one. The rules stay `gym_sessions.client.exchange`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import cast

from gym_sessions.client.exchange import Failure, TransportFailure
from gym_sessions.errors import RefusedReplyError

__all__ = ["IDLE_SECONDS", "Http11Connection"]

#: The client drops an idle connection before the server would (uvicorn's
#: keep-alive timeout here is 120 s), so it never sends into one being closed.
IDLE_SECONDS = 60.0
#: A reply head larger than this is refused (the connection is dropped).
_MAX_HEAD_BYTES = 64 * 1024

ReplyParts = tuple[int, list[tuple[str, str]], bytes]


class _TooLarge(ValueError):
    pass


class _ReplyReader(asyncio.Protocol):
    """Buffers what the server sends; `reply` resolves once one whole reply is in."""

    def __init__(self, max_body_bytes: int | None = None) -> None:
        self.max_body_bytes = max_body_bytes
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[ReplyParts] | None = None
        self.lost: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not an `asyncio.Transport` subclass).
        self.transport = cast("asyncio.Transport", transport)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:
            # Bytes no request asked for (while idle, or after a whole reply): the
            # connection is out of step, and the next request could read them as
            # its reply. Drop it; the pool or the client opens a new one.
            self._out_of_step("the server sent bytes no request asked for")
            return
        self.buffer += data
        self._deliver()

    def _out_of_step(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason
        self.buffer.clear()
        if self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        self.connection_lost(None)
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = str(exc) if exc else "the server closed the connection"
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(TransportFailure(Failure.LOST, self.lost))

    def expect(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[ReplyParts]:
        self.waiter = loop.create_future()
        if self.lost is not None:
            self.waiter.set_exception(TransportFailure(Failure.LOST, self.lost))
        else:
            self._deliver()
        return self.waiter

    def _deliver(self) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            return
        try:
            parsed = _parse_reply(self.buffer, self.max_body_bytes)
        except _TooLarge as exc:
            self.waiter = None
            waiter.set_exception(RefusedReplyError(f"the reply is larger than {exc} bytes"))
            return
        except ValueError as exc:
            self.waiter = None
            waiter.set_exception(TransportFailure(Failure.LOST, f"bad reply: {exc}"))
            return
        if parsed is not None:
            self.waiter = None
            reply, used = parsed
            del self.buffer[:used]
            waiter.set_result(reply)
            if self.buffer:
                self._out_of_step("the server sent more than the reply")


def _parse_reply(buffer: bytearray, max_body: int | None) -> tuple[ReplyParts, int] | None:
    """One whole reply at the start of ``buffer`` and its length, or ``None`` if more must come.

    Raises:
        ValueError: not an HTTP/1.x reply we can read (`_TooLarge`: a body over ``max_body``).
    """
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        if len(buffer) > _MAX_HEAD_BYTES:
            raise ValueError("reply head too large")
        return None
    lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    if not version.startswith("HTTP/1."):
        raise ValueError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    status = int(rest[:3])
    headers: list[tuple[str, str]] = []
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip(), value.strip()
        headers.append((name, value))
        lowered = name.lower()
        if lowered == "content-length":
            length = int(value)
            if length < 0:
                raise ValueError(f"a negative Content-Length: {value}")
        elif lowered == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    start = end + 4
    if status in (204, 304) or 100 <= status < 200:
        return (status, headers, b""), start
    if chunked:
        return _parse_chunked(buffer, start, status, headers, max_body)
    if length is None:
        raise ValueError("a reply without Content-Length on a kept-alive connection")
    if max_body is not None and length > max_body:
        raise _TooLarge(max_body)
    if len(buffer) - start < length:
        return None
    with memoryview(buffer) as view:  # one copy of the body, not two (a frame is 100 KB)
        body = bytes(view[start : start + length])
    return (status, headers, body), start + length


def _parse_chunked(
    buffer: bytearray, at: int, status: int, headers: list[tuple[str, str]], max_body: int | None
) -> tuple[ReplyParts, int] | None:
    if max_body is not None and len(buffer) - at > max_body + 64 * 1024:
        raise _TooLarge(max_body)  # more than the body and its chunk lines: never read it all
    body = bytearray()
    while True:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).split(b";", 1)[0], 16)
        at = line_end + 2
        if size == 0:
            trailer_end = buffer.find(b"\r\n\r\n", at - 2)
            if trailer_end < 0:
                return None
            return (status, headers, bytes(body)), trailer_end + 4
        if len(buffer) < at + size + 2:
            return None
        with memoryview(buffer) as view:
            body += view[at : at + size]
        if max_body is not None and len(body) > max_body:
            raise _TooLarge(max_body)
        at += size + 2


class Http11Connection:
    """Requests one after another over one connection to ``host:port`` (see the module).

    Args:
        host: Server host.
        port: Server port.
        timeout: Seconds for each reply, and for connecting (the TLS handshake
            included) unless ``connect_timeout`` says otherwise.
        keep_alive: Keep the connection between requests.
        ssl_context: Speak TLS with these settings (an ``https`` URL).
        connect_timeout: Seconds for connecting, if not ``timeout``.
        max_reply_bytes: A reply body larger than this is refused
            (`RefusedReplyError`) and the connection dropped; ``None``: no bound.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        timeout: float,
        keep_alive: bool = True,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float | None = None,
        max_reply_bytes: int | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.max_reply_bytes = max_reply_bytes
        self.keep_alive = keep_alive
        self.ssl_context = ssl_context
        self._host_line = f"Host: {host}:{port}\r\n"
        self._reader: _ReplyReader | None = None
        self._idle_since = 0.0
        self._lock = asyncio.Lock()

    async def round_trip(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> ReplyParts:
        """Send one request and read its reply (a `TransportFailure` if there is none)."""
        async with self._lock:
            reader = await self._connected()
            assert reader.transport is not None
            head = [f"{method} {target} HTTP/1.1\r\n", self._host_line]
            head += [f"{name}: {value}\r\n" for name, value in headers.items()]
            if body or method == "POST":
                head.append(f"Content-Length: {len(body)}\r\n")
            head.append("\r\n")
            loop = asyncio.get_running_loop()
            waiter = reader.expect(loop)
            try:
                reader.transport.write("".join(head).encode("latin-1") + body)
                async with asyncio.timeout(self.timeout):
                    status, reply_headers, reply_body = await waiter
            except TimeoutError as exc:
                self._abandon(waiter)  # its reply may still come: never read it as the next one's
                raise TransportFailure.of(Failure.TIMEOUT, exc) from exc
            except BaseException:
                # A failure, or interrupted mid-exchange (cancelled, SystemExit before
                # the await): the connection is out of step.
                self._abandon(waiter)
                raise
            if not self.keep_alive or any(
                name.lower() == "connection" and value.lower() == "close"
                for name, value in reply_headers
            ):
                self.close()
            self._idle_since = time.monotonic()
            return status, reply_headers, reply_body

    async def _connected(self) -> _ReplyReader:
        reader = self._reader
        if reader is not None and (
            reader.lost is not None or time.monotonic() - self._idle_since > IDLE_SECONDS
        ):
            self.close()
            reader = None
        if reader is None:
            loop = asyncio.get_running_loop()
            try:
                async with asyncio.timeout(self.connect_timeout):
                    transport, protocol = await loop.create_connection(
                        lambda: _ReplyReader(self.max_reply_bytes),
                        self.host,
                        self.port,
                        ssl=self.ssl_context,
                    )
            except TimeoutError as exc:
                raise TransportFailure(Failure.UNREACHABLE, "connect timed out") from exc
            except OSError as exc:
                raise TransportFailure(
                    Failure.UNREACHABLE,
                    f"cannot connect to {self.host}:{self.port}: {exc.strerror or exc}",
                ) from exc
            # uvloop calls `connection_made` soon after, not before this returns.
            protocol.transport = transport
            reader = self._reader = protocol
        return reader

    @property
    def is_open(self) -> bool:
        """Whether the connection is up and usable for the next request."""
        reader = self._reader
        return reader is not None and reader.lost is None

    def _abandon(self, waiter: asyncio.Future[ReplyParts]) -> None:
        if not waiter.done():
            waiter.cancel()  # nobody will read what it gets ("exception never retrieved")
        self.close()

    def shut_down(self) -> None:
        """End the connection without its loop (which has closed): shut the socket down."""
        reader, self._reader = self._reader, None
        if reader is not None and reader.transport is not None:
            with contextlib.suppress(Exception):
                reader.transport.get_extra_info("socket").shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Close the connection (a later request opens a new one); never raises."""
        reader, self._reader = self._reader, None
        if reader is not None and reader.transport is not None:
            with contextlib.suppress(Exception):
                reader.transport.close()
