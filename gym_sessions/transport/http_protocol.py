"""`BoundedHttpProtocol`: uvicorn's httptools protocol with request heads bounded as they arrive.

uvicorn buffers a request's head until it is complete, with no limit on its
size and no timeout: one 128 MiB header value cost a worker 15 s of CPU
(quadratic) and a head that never ends held its memory and connection forever.
This protocol counts the bytes of a head while it arrives and, at the moment
they cross ``max_head_bytes``, answers 431 ``headers_too_large`` and closes the
connection without reading the rest; a head not complete within
``head_timeout`` seconds of its first byte (or a new connection that sends
nothing for that long) is answered 408 ``request_timeout`` (nothing, if it sent
nothing) and closed. A worker then holds at most ``max_head_bytes`` plus one
read (256 KiB) per connection, and parses each byte once.

Everything after the head (bodies, replies, keep-alive, pipelining) is
uvicorn's own, but for one thing: a reply's head leaves in the same write as
its first body bytes (`CoalescedCycle`). The router still checks the parsed head's size (431) for
requests that reach it by other paths (the private listeners).

It is also the one protocol whose connections can be handed to another worker
(`gym_sessions.routing.handoff`): each request's scope carries the connection
(`CONNECTION_SCOPE_KEY`), which tells whether it can be given away now
(`detachable`: nothing of a further request read) and gives it away
(`give_away`); on the receiving side `expect_replay` marks the replayed request.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any, cast

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from gym_sessions.errors import (
    HeadersTooLargeError,
    HTTPError,
    RequestTimeoutError,
    error_body,
    error_headers,
)
from gym_sessions.scope_keys import CONNECTION_SCOPE_KEY, HANDED_IN_SCOPE_KEY
from gym_sessions.transport.coalesced_cycle import CoalescedCycle

__all__ = ["TESTED_UVICORN", "BoundedHttpProtocol", "uvicorn_tested"]

#: uvicorn versions whose protocol internals handoff and `CoalescedCycle` were tested
#: against (``cycle``, ``pipeline``, ``parser``, ``flow``, the scope made in
#: ``on_message_begin``, the cycle's writes through its ``transport``).
TESTED_UVICORN = ((0, 54),)


def uvicorn_tested(version: str = uvicorn.__version__) -> bool:
    """Whether uvicorn ``version`` is one the internals here were tested against.

    ``make uvicorn-latest`` runs this package's tests against the newest
    uvicorn: on one outside `TESTED_UVICORN` they show handoff and coalesced
    replies off; add it here once they pass with the gate forced open.
    """
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED_UVICORN


_REASONS = {
    408: b"Request Timeout",
    431: b"Request Header Fields Too Large",
    503: b"Service Unavailable",
}


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools HTTP/1.1 protocol with bounded request heads.

    ``handoff_enabled`` is false on a uvicorn outside `TESTED_UVICORN`: its
    connections are then never handed over (the router hops). So is
    ``coalesces_replies``: replies are then written as uvicorn writes them.

    Args:
        *args: As for uvicorn's ``HttpToolsProtocol``.
        max_head_bytes: Bytes a request head may take (request line and headers).
        head_timeout: Seconds from a head's first byte (or from the connection's
            start) until the head must be complete.
        **kwargs: As for uvicorn's ``HttpToolsProtocol``.
    """

    handoff_enabled = uvicorn_tested()
    #: Each reply's head leaves with its first body bytes (`CoalescedCycle`); the
    #: cycle's writes are uvicorn internals too.
    coalesces_replies = uvicorn_tested()

    def __init__(self, *args: Any, max_head_bytes: int, head_timeout: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_head_bytes = max_head_bytes
        self.head_timeout = head_timeout
        # Bytes of the head being received, or None between heads.
        self._head_bytes: int | None = 0
        self._head_timer: asyncio.TimerHandle | None = None
        # A message ended inside the chunk being parsed: the chunk is (mostly)
        # that message's body, not the next head, so it is not counted.
        self._message_ended = False
        # The worker whose handed-over request is the next one parsed here, if any.
        self._replay_from: str | None = None
        #: Requests begun on this connection (here: a handed one counts from its replay).
        self.requests_begun = 0
        #: The connection came to this worker by handoff (`expect_replay`), not by accept.
        self.handed_in = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()  # a connection that never sends a request ends too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)
        if self.scope is not None:
            self.scope.pop(CONNECTION_SCOPE_KEY, None)  # type: ignore[misc]  # no cycle to collect

    def data_received(self, data: bytes) -> None:
        self._message_ended = False
        super().data_received(data)
        if self._head_bytes is None or self._message_ended or self.transport.is_closing():
            return
        # Still inside a head after this chunk: count it. (A pipelined head that
        # began in the chunk that ended the previous message is counted from
        # the next chunk on: at most one read more than the limit.)
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes:
            self._refuse(
                HeadersTooLargeError(f"the request head is larger than {self.max_head_bytes} bytes")
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.requests_begun += 1
        self.scope[CONNECTION_SCOPE_KEY] = self  # type: ignore[literal-required]
        if self._replay_from is not None:
            self.scope[HANDED_IN_SCOPE_KEY] = self._replay_from  # type: ignore[literal-required]
            self._replay_from = None
        self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._disarm_head_timer()
        super().on_headers_complete()
        cycle = self.cycle
        if self.coalesces_replies and type(cycle) is RequestResponseCycle:
            # The cycle uvicorn just made (none for an upgrade): its reply in one write.
            cycle.__class__ = CoalescedCycle
            cast("CoalescedCycle", cycle).loop = self.loop

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_bytes = 0  # the next bytes begin the next head
        self._message_ended = True

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self._head_bytes is None:
            return
        if self._head_bytes == 0 and not self._replying():
            self.transport.close()  # nothing sent (or an idle keep-alive): just close
            return
        self._refuse(
            RequestTimeoutError(f"the request head was not complete within {self.head_timeout:g} s")
        )

    def _replying(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _refuse(self, error: HTTPError) -> None:
        """Answer ``error`` and close; the rest of the head is never read."""
        self._disarm_head_timer()
        self._head_bytes = None
        if not self._replying():  # a reply under way must not be cut by ours
            body = error_body(error)
            extra = b"".join(b"%s: %s\r\n" % header for header in error_headers(error))
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: close\r\n%s\r\n%s"
                % (error.status, _REASONS[error.status], len(body), extra, body)
            )
        self.transport.close()

    # Handoff (gym_sessions.routing.handoff) ----------------------------------------------

    def detachable(self, scope: MutableMapping[str, Any]) -> bool:
        """Whether this connection can be given away with the request of ``scope``.

        Only while that request is the last one begun, its body was read to
        the end, nothing of a further request was read (no pipelined request
        queued, no byte after the body: httptools begins the next message as
        soon as its first byte is parsed), on plain HTTP/1.1 that stays open,
        not asking for an upgrade, and on a transport that is a bare socket (TLS is not).
        """
        cycle = self.cycle
        transport = self.transport
        return (
            cycle is not None
            and cycle.scope is scope
            and not cycle.more_body
            and not cycle.body
            and not cycle.response_started
            and not cycle.disconnected
            and cycle.keep_alive
            and not self.pipeline
            and self.scope is scope  # no further request begun (it would have a scope of its own)
            and scope.get("http_version") == "1.1"
            and not self.parser.should_upgrade()
            and transport is not None
            and not transport.is_closing()
            and transport.get_extra_info("sslcontext") is None
            and transport.get_extra_info("socket") is not None
        )

    def pause_for_handoff(self) -> None:
        """Read nothing more from the client while the connection is offered to another worker."""
        self.transport.pause_reading()
        # uvicorn's flow control resumes reading only if it paused it itself
        # (``read_paused``): marked as not paused by it, a ``receive`` while the
        # offer is open (the disconnect watch) cannot resume reading a socket
        # the other worker may already be reading.
        self.flow.read_paused = False

    def resume_after_refusal(self) -> None:
        """The other worker did not take the connection: this one serves it on."""
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def silence(self) -> None:
        """uvicorn writes nothing more for the current request (another worker may answer it)."""
        self.cycle.disconnected = True

    def give_away(self) -> None:
        """Let go of the connection another worker now holds a descriptor of.

        The request is marked disconnected first, so uvicorn neither answers
        it (its 500 for an app that sent nothing) nor logs it; then the
        transport closes this worker's descriptor without a shutdown or a
        reset: the connection lives on in the other worker.
        """
        self.silence()
        self.cycle.keep_alive = False
        self._disarm_head_timer()
        self.transport.abort()

    def expect_replay(self, sender: str) -> None:
        """The next request parsed here is the replay of one ``sender`` handed over."""
        self._replay_from = sender
        self.handed_in = True
