"""Connection handoff: give a client's connection to the session's holder instead of hopping.

When a request reaches a worker that does not hold its session, `Handoff`
passes the client's socket itself (``SCM_RIGHTS``) to the holder over the
holder's handoff socket (``<runtime dir>/workers/<id>.fds``, one host only),
with the request rebuilt from what this worker parsed (`replay_bytes`). The
holder answers one byte: taken or refused. Taken: this worker lets go of the
connection without a byte more (`BoundedHttpProtocol.give_away`); the holder
serves the request and every later one on that connection. Refused, or
anything that makes a handoff unsafe (`HopReason`): the router hops as before
(`gym_sessions.routing.forwarder`). The receiving side is
`gym_sessions.routing.handoff_listener`. docs/design.md §3.10.6.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import logging
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.types import Scope

from gym_sessions.routing.hop_headers import forwarded_headers, request_target
from gym_sessions.scope_keys import CONNECTION_SCOPE_KEY, GIVEN_AWAY_SCOPE_KEY
from gym_sessions.transport.http_protocol import BoundedHttpProtocol

__all__ = [
    "ACK_REFUSED",
    "ACK_TAKEN",
    "MAGIC",
    "MAX_MESSAGE_BYTES",
    "Handoff",
    "HandoffCounts",
    "HandoffLost",
    "HandoffUndecided",
    "HopReason",
    "pack_message",
    "replay_bytes",
    "unpack_message",
]

logger = logging.getLogger("gym_sessions.routing")

#: First bytes of every handoff message (a version: both ends run the same code).
MAGIC = b"GSH1"
ACK_TAKEN = b"\x01"
ACK_REFUSED = b"\x00"
#: A message (header, session id and replayed request) fits a Unix socket's
#: default send buffer (208 KiB on Linux) with room to spare; a larger
#: request is hopped.
MAX_MESSAGE_BYTES = 160 * 1024
_HEADER = struct.Struct("!4sHH")
_ID_MAX = 1024


class HopReason(enum.Enum):
    """Why a request was hopped rather than handed over (``/health`` counts each)."""

    #: The request's protocol is not `BoundedHttpProtocol` (or not the tested uvicorn).
    PROTOCOL = "protocol"
    #: The connection's first request: it may be its only one (`Handoff.from_request`).
    FIRST_REQUEST = "first_request"
    #: The connection was handed here a few requests ago (`Handoff.again_from_request`):
    #: one that keeps moving carries many sessions, and for it the hop costs less.
    MOVED_RECENTLY = "moved_recently"
    #: Bytes of a further request were read (pipelined), or the connection is
    #: not plain, kept-alive HTTP/1.1 on a bare socket (TLS, upgrade, closing).
    NOT_DETACHABLE = "not_detachable"
    #: The rebuilt request does not fit one handoff message.
    TOO_LARGE = "too_large"
    #: The holder's handoff socket is missing, refused or full.
    UNREACHABLE = "unreachable"
    #: The holder answered that it does not take the connection (not holding, draining).
    REFUSED = "refused"
    #: The holder's handoff socket closed before it answered (it exited).
    LOST = "lost"


@dataclass
class HandoffCounts:
    """Requests this worker sent to another worker's holder: handed over or hopped."""

    handed_over: int = 0
    hopped: int = 0
    hop_reasons: dict[str, int] = field(default_factory=dict)
    #: Connections let go unserved because the holder's answer could no longer be read.
    undecided: int = 0

    def hop(self, reason: HopReason | None) -> None:
        """Count a hop, and why it was not a handoff (``None``: handoff is off)."""
        self.hopped += 1
        if reason is not None:
            self.hop_reasons[reason.value] = self.hop_reasons.get(reason.value, 0) + 1

    def as_json(self) -> dict[str, Any]:
        """The counts as ``/health`` shows them."""
        return {
            "handed_over": self.handed_over,
            "hopped": self.hopped,
            "hop_reasons": dict(self.hop_reasons),
            "undecided": self.undecided,
        }


def replay_bytes(scope: Scope, body: bytes) -> bytes:
    """The request as the holder parses it: rebuilt from what this worker parsed.

    Method, raw target, the headers the hop forwards (no hop-by-hop ones, no
    ``expect``, no ``transfer-encoding``) and the whole body with a fresh
    ``content-length``: the holder's parser never sees bytes this worker's
    parser read differently (no request smuggling).
    """
    lines = [b"%s %s HTTP/1.1" % (scope["method"].encode("ascii"), request_target(scope))]
    lines += [name + b": " + value for name, value in forwarded_headers(scope)]
    lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def pack_message(session_id: str, sender: str, replay: bytes) -> bytes:
    """One handoff message: magic, session id, the sending worker's id, replayed request."""
    sid, by = session_id.encode(), sender.encode()
    return _HEADER.pack(MAGIC, len(sid), len(by)) + sid + by + replay


def unpack_message(message: bytes) -> tuple[str, str, bytes] | None:
    """``(session id, sender, replayed request)`` of a message, or ``None`` if malformed."""
    if len(message) < _HEADER.size:
        return None
    magic, sid_length, by_length = _HEADER.unpack_from(message)
    start = _HEADER.size
    end = start + sid_length + by_length
    if magic != MAGIC or max(sid_length, by_length) > _ID_MAX or len(message) < end:
        return None
    try:
        sid = message[start : start + sid_length].decode()
        by = message[start + sid_length : end].decode()
    except UnicodeDecodeError:
        return None
    return sid, by, message[end:]


class HandoffLost(ConnectionError):
    """The holder's socket reached its end before it answered: it served nothing of it."""


class HandoffUndecided(ConnectionError):
    """Whether the holder took the connection cannot be known any more."""


class _Channel:
    """One kept-open handoff socket to a holder; its answers come back in order.

    A question is settled only by its answer byte, or by the end of the
    socket read after every answer before it: the holder answers before it
    serves, and writes every answer it owes before it closes, so whatever was
    unanswered at the end was never served there (`HandoffLost`). A question
    whose answer can no longer be read (this worker closes the channel itself,
    or reading fails) is `HandoffUndecided`: its connection may be the
    holder's, so this worker must let it go without serving it.
    """

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock = sock
        self.loop = loop
        self.pending: collections.deque[asyncio.Future[bool]] = collections.deque()
        self.closed = False
        #: New questions may be sent (false once a send found the holder's end closed).
        self.open_for_questions = True
        loop.add_reader(sock.fileno(), self._read_answers)

    def send(self, message: bytes, fd: int) -> asyncio.Future[bool]:
        """Send ``message`` with a descriptor of ``fd``; the future says whether it was taken.

        Raises:
            OSError: nothing was sent (the socket is full or broken).
        """
        try:
            socket.send_fds(self.sock, [message], [fd])
        except (BrokenPipeError, ConnectionResetError):
            # The holder closed its end; the answers it wrote before are still
            # to be read (the reader settles every open question), but no new
            # question goes out on this socket.
            self.open_for_questions = False
            raise
        answer: asyncio.Future[bool] = self.loop.create_future()
        self.pending.append(answer)
        return answer

    def _read_answers(self) -> None:
        # Every answer waiting is read now: one per wake-up would let them pile
        # up in the holder's send buffer while this worker sends more questions.
        while not self.closed:
            try:
                data = self.sock.recv(4096)
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionResetError:
                # Linux reports a peer that closed with questions unread once,
                # before the answers it wrote: read on.
                continue
            except OSError:
                self.close(HandoffUndecided("the holder's handoff socket could not be read"))
                return
            if not data:
                # The end, after every answer the holder wrote: the rest were never taken.
                self.close(HandoffLost("the holder's handoff socket closed before it answered"))
                return
            for byte in data:
                if not self.pending:
                    break
                answer = self.pending.popleft()
                if not answer.done():
                    answer.set_result(byte == ACK_TAKEN[0])

    def close(self, reason: ConnectionError | None = None) -> None:
        """Stop reading; every open question fails with ``reason`` (undecided by default)."""
        if self.closed:
            return
        self.closed = True
        self.open_for_questions = False
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self.sock.close()
        if reason is None:
            reason = HandoffUndecided("this worker closed its handoff socket")
        while self.pending:
            answer = self.pending.popleft()
            if not answer.done():
                answer.set_exception(reason)


class Handoff:
    """The accepting side of connection handoff (one per routed worker on one host).

    Args:
        worker_id: This worker's id (the holder names it in debug headers).
        socket_path: The handoff socket path of a worker id
            (`RuntimeDirectory.handoff_path`).
        counts: Where handoffs and hops are counted.

    A connection is handed over from its `from_request`-th request on (2): a
    connection's first request may well be its last (a client that connects
    for each request), and for one request the hop costs less than moving
    the connection (``benchmarks/LOG.md``, "Connection handoff"). A
    connection handed to this worker is handed on only from its
    `again_from_request`-th request here (16, its replay the first): so a
    connection moves at most once per 15 requests, and one that carries many
    sessions held by different workers (a proxy's or a client's pool) stays
    where it is and hops, which costs less than a move per request
    (``benchmarks/LOG.md``, "Many sessions on one kept-alive connection").
    """

    #: The first request of a connection that may be handed over (1: any).
    from_request = 2
    #: The same for a connection that was handed to this worker (its replay is its first).
    again_from_request = 16

    def __init__(
        self, worker_id: str, socket_path: Callable[[str], str], counts: HandoffCounts
    ) -> None:
        self.worker_id = worker_id
        self._socket_path = socket_path
        self._channels: dict[str, _Channel] = {}
        self._draining: set[_Channel] = set()
        self.counts = counts

    async def hand_over(self, holder: str, session_id: str, scope: Scope, body: bytes) -> bool:
        """Give the request's connection to ``holder``; ``False``: hop instead (counted).

        ``True`` means the holder took the connection: this worker sends
        nothing for the request and reads nothing more from the connection.
        """
        connection = scope.get(CONNECTION_SCOPE_KEY)
        if not isinstance(connection, BoundedHttpProtocol) or not connection.handoff_enabled:
            return self._hop(HopReason.PROTOCOL)
        if connection.handed_in:
            if connection.requests_begun < self.again_from_request:
                return self._hop(HopReason.MOVED_RECENTLY)
        elif connection.requests_begun < self.from_request:
            return self._hop(HopReason.FIRST_REQUEST)
        if not connection.detachable(scope):
            return self._hop(HopReason.NOT_DETACHABLE)
        message = pack_message(session_id, self.worker_id, replay_bytes(scope, body))
        if len(message) > MAX_MESSAGE_BYTES:
            return self._hop(HopReason.TOO_LARGE)
        channel = self._channel(holder)
        if channel is None:
            return self._hop(HopReason.UNREACHABLE)
        client = connection.transport.get_extra_info("socket")
        # Nothing more is read here from now on: what the client sends next
        # stays in the kernel for whichever worker serves the connection.
        connection.pause_for_handoff()
        try:
            answer = channel.send(message, client.fileno())
        except OSError:
            # Nothing was sent: the holder is behind (its socket is full) or has
            # closed its end. Either way the questions already sent are settled
            # by the channel's reader, never here.
            connection.resume_after_refusal()
            return self._hop(HopReason.UNREACHABLE)
        try:
            # Shielded: once sent, the connection may be the holder's whatever
            # happens to this task, so the answer is always acted on.
            taken = await asyncio.shield(answer)
        except asyncio.CancelledError:
            # uvicorn must not answer the request (the holder may be serving
            # it); the connection goes with the late answer, taken or not.
            connection.silence()
            answer.add_done_callback(lambda _: connection.give_away())
            raise
        except HandoffLost:
            # The holder's socket ended before it answered: it never served the
            # request (it answers before it serves), so the hop (410, or a restore) is safe.
            connection.resume_after_refusal()
            return self._hop(HopReason.LOST)
        except HandoffUndecided:
            # The holder may be serving the connection: never serve it here too.
            connection.give_away()
            scope[GIVEN_AWAY_SCOPE_KEY] = True
            self.counts.undecided += 1
            return True
        if not taken:
            connection.resume_after_refusal()
            return self._hop(HopReason.REFUSED)
        connection.give_away()
        scope[GIVEN_AWAY_SCOPE_KEY] = True
        self.counts.handed_over += 1
        return True

    def _hop(self, reason: HopReason) -> bool:
        self.counts.hop(reason)
        return False

    def _channel(self, holder: str) -> _Channel | None:
        channel = self._channels.get(holder)
        if channel is not None and channel.open_for_questions:
            return channel
        if channel is not None and not channel.closed:
            # It takes no more questions but still reads its answers to the end.
            self._draining.add(channel)
            del self._channels[holder]
        self._draining = {old for old in self._draining if not old.closed}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        try:
            # A Unix connect completes at once, or fails (gone, refused, backlog full).
            sock.connect(self._socket_path(holder))
        except OSError:
            sock.close()
            return None
        channel = self._channels[holder] = _Channel(sock, asyncio.get_running_loop())
        return channel

    def close(self) -> None:
        """Close every handoff socket (a question still open there is undecided)."""
        for channel in [*self._channels.values(), *self._draining]:
            channel.close()
        self._channels.clear()
        self._draining.clear()
