"""`CoalescedCycle`: uvicorn's request cycle writing a reply's head with its first body bytes.

uvicorn writes the head of a reply (status line and headers) as soon as the
app sends ``http.response.start``, and the body with the next message: two
socket writes, and on loopback two wake-ups of the client, for every small
reply. Sampled over HTTP, the head's write alone was a quarter of a 1-worker
server's busy time. Here the head is held until the app's next message and
goes out in the same write as that message's bytes.

A head is never held past the loop's turn: if the app suspends between the
two messages (a streamed reply waiting for its first chunk), a callback
scheduled with the head writes it alone, as uvicorn would have. uvicorn
builds both writes itself (its header checks, lengths, chunking, keep-alive
and close): the cycle only lends it a transport that keeps the head, then
one that prepends it to the next write. Under write back-pressure (uvicorn's
flow control paused) nothing is held. Private listeners (the hop) do not
coalesce: there the head's early write lets the forwarding worker start
while the holder writes the body (`gym_sessions.transport.private_listener`).
A large first message (pixel observations: a step batch of Pong frames is
hundreds of KB) goes with its head in one ``writelines``, one vectored write
in uvloop, rather than copied behind the head: sampled at 1 worker serving
Pong step batches, that copy was 7.5% of the server's time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

__all__ = ["CoalescedCycle"]

#: Bytes from which a held head and the next message leave as two buffers of one
#: ``writelines`` instead of one concatenated copy (below, the copy costs less).
VECTORED_WRITE_BYTES = 16 * 1024


class _HeadKeeper:
    """Stands in for the transport while uvicorn writes a head: keeps the bytes."""

    __slots__ = ("head",)

    def __init__(self) -> None:
        self.head = b""

    def write(self, data: bytes) -> None:
        self.head += data


class _HeadFirst:
    """Stands in for the transport while uvicorn writes the next message: head first."""

    __slots__ = ("head", "transport")

    def __init__(self, transport: asyncio.Transport, head: bytes) -> None:
        self.transport = transport
        self.head: bytes | None = head

    def write(self, data: bytes) -> None:
        head, self.head = self.head, None
        if head is None:
            self.transport.write(data)
        elif len(data) >= VECTORED_WRITE_BYTES:
            self.transport.writelines((head, data))
        else:
            self.transport.write(head + data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def flush(self) -> None:
        """Write a head no write took (uvicorn raised before writing)."""
        if self.head is not None:
            head, self.head = self.head, None
            if not self.transport.is_closing():
                self.transport.write(head)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class CoalescedCycle(RequestResponseCycle):
    """A `RequestResponseCycle` whose reply head leaves in one write with the first body bytes.

    `BoundedHttpProtocol` turns the cycle uvicorn made into one (``__class__``
    set, then `loop`): it adds no state of its own but the held head.
    """

    _held: bytes | None = None
    _flush: asyncio.Handle | None = None
    #: The connection's loop (the protocol's), set with the class.
    loop: asyncio.AbstractEventLoop

    async def send(self, message: Any) -> None:
        if not self.disconnected and self.transport.is_closing():
            # uvicorn marks only the connection's newest cycle disconnected when
            # it is lost; an older one still replying (a request answered while
            # a pipelined one was read) must not write into the closed transport.
            self.disconnected = True
        held = self._held
        if held is not None:
            self._held = None
            assert self._flush is not None
            self._flush.cancel()
            transport = self.transport
            head_first = _HeadFirst(transport, held)
            self.transport = head_first  # type: ignore[assignment]
            try:
                await super().send(message)
            finally:
                self.transport = transport
                head_first.flush()
            return
        if (
            message["type"] != "http.response.start"
            or self.response_started
            or self.disconnected
            or self.flow.write_paused
        ):
            await super().send(message)
            return
        transport = self.transport
        keeper = _HeadKeeper()
        self.transport = keeper  # type: ignore[assignment]
        try:
            await super().send(message)
        finally:
            self.transport = transport
        if keeper.head:
            self._held = keeper.head
            self._flush = self.loop.call_soon(self._write_held)

    def _write_held(self) -> None:
        """The app suspended after its reply's start: the head goes out alone."""
        held, self._held = self._held, None
        if held is not None and not self.disconnected and not self.transport.is_closing():
            self.transport.write(held)
