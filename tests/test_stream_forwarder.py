"""The shipped hop (`gym_sessions.routing.stream_forwarder`) against fake and scripted claimants.

Two kinds of claimant, both in process and without sleeps:

- a pooled connection whose reader is an `asyncio.StreamReader` fed by the test
  and whose writer records what the hop wrote: the reply's framing byte by byte,
  pieces fed exactly when the hop has sent the previous one on;
- a scripted private listener on a real Unix socket at the claimant's path in a
  real runtime directory (`UnixEndpoints`), for new connections, reachability
  and the resend of a request on a pooled connection the claimant had closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import httptools
import pytest

from gym_sessions.errors import BadGatewayError, ForbiddenError, SessionGoneError
from gym_sessions.routing import stream_forwarder
from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.routing.forwarder import HolderRefusedError
from gym_sessions.routing.stream_forwarder import StreamForwarder, _Connection, _request_head
from gym_sessions.routing.worker_endpoints import UnixEndpoints
from gym_sessions.runtime_dir import RuntimeDirectory

WORKER = "w1-claimant"
SECRET = "stream-forwarder-test-secret-" + "x" * 20
OK_HELLO = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n\r\nhello"


class RecordingWriter:
    """The part of `asyncio.StreamWriter` the hop uses, recording every write."""

    def __init__(self, on_write: Callable[[bytes], None] | None = None) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.on_write = on_write

    def write(self, data: bytes) -> None:
        assert not self.closed, "write on a closed connection"
        self.writes.append(data)
        if self.on_write is not None:
            self.on_write(data)

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class FakeConnection:
    """A pooled hop connection whose reply the test feeds."""

    def __init__(self, reply: bytes = b"", *, on_write: Callable[[bytes], None] | None = None):
        self.reader = asyncio.StreamReader()
        if reply:
            self.reader.feed_data(reply)
        self.writer = RecordingWriter(on_write)
        self.connection = _Connection(self.reader, self.writer)  # type: ignore[arg-type]

    @property
    def written(self) -> bytes:
        return b"".join(self.writer.writes)


class Sent:
    """An ASGI ``send`` that records the reply; may feed the next piece after each body message."""

    def __init__(self, feed: tuple[FakeConnection, list[bytes]] | None = None) -> None:
        self.messages: list[dict[str, Any]] = []
        self.feed = feed

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)
        if self.feed is not None and message["type"] == "http.response.body":
            connection, pieces = self.feed
            if pieces:
                connection.reader.feed_data(pieces.pop(0))

    @property
    def start(self) -> dict[str, Any]:
        return self.messages[0]

    @property
    def body(self) -> bytes:
        return b"".join(m["body"] for m in self.messages[1:])

    @property
    def finished(self) -> bool:
        return self.messages[-1]["type"] == "http.response.body" and not self.messages[-1].get(
            "more_body", False
        )


def make_scope(
    method: str = "POST",
    path: str = "/step",
    query: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
) -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "headers": headers if headers is not None else [(b"host", b"worker")],
    }


async def forward(
    forwarder: StreamForwarder,
    send: Sent,
    *,
    scope: dict[str, Any] | None = None,
    body: bytes = b"{}",
) -> None:
    # A hop that waits for bytes that never come fails here, not at the suite's timeout.
    async with asyncio.timeout(5):
        await forwarder.forward(WORKER, scope or make_scope(), body, send)


def pool(forwarder: StreamForwarder, *connections: FakeConnection) -> None:
    """Put ``connections`` in the claimant's idle pool (the last one is taken first)."""
    forwarder._idle[WORKER] = deque(c.connection for c in connections)


def pooled(forwarder: StreamForwarder) -> list[Any]:
    return list(forwarder._idle.get(WORKER, ()))


class ScriptedClaimant:
    """A private listener on a real Unix socket answering each request with the next script line.

    Each line is ``(reply bytes, close after)``; connections that send no
    complete request head (reachability probes) are not counted.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.script: deque[tuple[bytes, bool]] = deque()
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.server: asyncio.Server | None = None
        self._handlers: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self.server = await asyncio.start_unix_server(self._serve, self.path)

    async def stop(self) -> None:
        """Stop listening and end the connections still open (pooled by a hop, say)."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for writer in self._handlers.values():
            writer.close()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers[task] = writer
        counted = False
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                if not counted:
                    self.connections += 1
                    counted = True
                length = re.search(rb"\r\ncontent-length: (\d+)\r\n", head)
                assert length is not None
                body = await reader.readexactly(int(length.group(1)))
                self.requests.append((head, body))
                reply, close = self.script.popleft()
                writer.write(reply)
                await writer.drain()
                if close:
                    return
        finally:
            writer.close()
            del self._handlers[task]


@pytest.fixture
def runtime_dir(short_tmp) -> RuntimeDirectory:
    return RuntimeDirectory.create(short_tmp)


@pytest.fixture
async def forwarder(runtime_dir) -> AsyncIterator[StreamForwarder]:
    hop = StreamForwarder(UnixEndpoints(runtime_dir))
    yield hop
    await hop.close()


@pytest.fixture
async def claimant(runtime_dir) -> AsyncIterator[ScriptedClaimant]:
    listener = ScriptedClaimant(runtime_dir.socket_path(WORKER))
    await listener.start()
    yield listener
    await listener.stop()


# The request head ----------------------------------------------------------------------------


def test_the_request_head_drops_hop_by_hop_headers_and_sets_the_length():
    scope = make_scope(
        path="/rollouts/r 1/step",
        query=b"x=1&y=%20",
        headers=[
            (b"host", b"example"),
            (b"connection", b"keep-alive"),
            (b"content-length", b"999"),
            (b"transfer-encoding", b"chunked"),
            (b"expect", b"100-continue"),
            (b"x-gym-forward-signature", b"forged"),
            (b"te", b"trailers"),
            (b"upgrade", b"h2c"),
            (b"cookie", b"gym_session=abc"),
            (b"x-gym-session-token", b"tok"),
        ],
    )
    scope["raw_path"] = b"/rollouts/r%201/step"
    assert _request_head(scope, 12, None) == (
        b"POST /rollouts/r%201/step?x=1&y=%20 HTTP/1.1\r\n"
        b"host: example\r\n"
        b"cookie: gym_session=abc\r\n"
        b"x-gym-session-token: tok\r\n"
        b"content-length: 12\r\n\r\n"
    )


def test_the_request_head_without_raw_path_or_query_and_with_a_signature():
    scope = make_scope(method="GET", path="/health", headers=[])
    del scope["raw_path"]
    assert _request_head(scope, 0, (b"x-gym-forward-signature", b"1.d.m")) == (
        b"GET /health HTTP/1.1\r\nx-gym-forward-signature: 1.d.m\r\ncontent-length: 0\r\n\r\n"
    )


async def test_a_small_request_is_one_write_a_large_one_two_without_a_copy(forwarder):
    head = b"POST /step HTTP/1.1\r\nhost: worker\r\ncontent-length: %d\r\n\r\n"
    small_body = b"s" * (64 * 1024 - 1)
    small = FakeConnection(OK_HELLO)
    pool(forwarder, small)
    await forward(forwarder, Sent(), body=small_body)
    assert small.writer.writes == [head % len(small_body) + small_body]

    large_body = b"L" * (64 * 1024)
    large = FakeConnection(OK_HELLO)
    pool(forwarder, large)
    await forward(forwarder, Sent(), body=large_body)
    assert len(large.writer.writes) == 2
    assert large.writer.writes[0] == head % len(large_body)
    assert large.writer.writes[1] is large_body


async def test_a_signed_hop_signs_what_it_sends_for_that_worker_only(runtime_dir):
    signer = ForwardSigner(SECRET)
    hop = StreamForwarder(UnixEndpoints(runtime_dir), signer)
    connection = FakeConnection(OK_HELLO)
    pool(hop, connection)
    headers = [(b"host", b"worker"), (b"x-gym-forward-signature", b"forged"), (b"cookie", b"c")]
    body = b'{"action": 1}'
    await forward(hop, Sent(), scope=make_scope(query=b"q=1", headers=headers), body=body)
    await hop.close()
    head, _, sent_body = connection.written.partition(b"\r\n\r\n")
    assert sent_body == body
    request_line, *lines = head.split(b"\r\n")
    assert request_line == b"POST /step?q=1 HTTP/1.1"
    received = [tuple(line.split(b": ", 1)) for line in lines]
    assert [name for name, _ in received].count(b"x-gym-forward-signature") == 1
    assert (b"x-gym-forward-signature", b"forged") not in received
    # The claimant's listener accepts it (for this worker) and checks the body against it.
    as_received = make_scope(path="/step", query=b"q=1", headers=received)
    digest = ForwardSigner(SECRET).verify_head(as_received, WORKER)
    assert digest == hashlib.sha256(body).hexdigest().encode()
    with pytest.raises(ForbiddenError):
        ForwardSigner(SECRET).verify_head(as_received, "w2-another")


# Reply framing -------------------------------------------------------------------------------


async def test_a_content_length_reply_is_streamed_and_its_connection_pooled(forwarder):
    connection = FakeConnection(OK_HELLO)
    pool(forwarder, connection)
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.messages == [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/plain"), (b"content-length", b"5")],
        },
        {"type": "http.response.body", "body": b"hello", "more_body": False},
    ]
    assert pooled(forwarder) == [connection.connection]
    assert not connection.writer.closed
    assert connection.connection.idle_timer is not None  # closes itself if left idle


async def test_a_body_arriving_in_pieces_is_sent_on_as_it_arrives(forwarder):
    connection = FakeConnection(b"HTTP/1.1 201 Created\r\nContent-Length: 11\r\n\r\nhel")
    pool(forwarder, connection)
    sent = Sent(feed=(connection, [b"lo wo", b"rld"]))
    await forward(forwarder, sent)
    assert sent.start["status"] == 201
    assert [(m["body"], m["more_body"]) for m in sent.messages[1:]] == [
        (b"hel", True),
        (b"lo wo", True),
        (b"rld", False),
    ]
    assert pooled(forwarder) == [connection.connection]


async def test_a_chunked_reply_is_unframed_and_its_transfer_encoding_dropped(forwarder):
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/csv\r\n\r\n"
    connection = FakeConnection(head + b"5\r\nhello\r\n")
    pool(forwarder, connection)
    sent = Sent(feed=(connection, [b"6\r\n world\r\n", b"0\r\n\r\n"]))
    await forward(forwarder, sent)
    assert sent.start["headers"] == [(b"content-type", b"text/csv")]
    assert [(m["body"], m["more_body"]) for m in sent.messages[1:]] == [
        (b"hello", True),
        (b" world", True),
        (b"", False),
    ]
    assert pooled(forwarder) == [connection.connection]


async def test_a_whole_chunked_reply_in_one_read_is_one_body_message(forwarder):
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    pool(forwarder, FakeConnection(reply))
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.messages[1:] == [
        {"type": "http.response.body", "body": b"abcde", "more_body": False}
    ]


async def test_reply_headers_are_lower_cased_repeated_and_without_hop_by_hop_ones(forwarder):
    reply = (
        b"HTTP/1.1 409 Conflict\r\n"
        b"Content-Type: application/json\r\n"
        b"Set-Cookie: a=1\r\n"
        b"Connection: keep-alive\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"Set-Cookie: b=2\r\n"
        b"X-Gym-Worker: w1\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )
    pool(forwarder, FakeConnection(reply))
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.start["status"] == 409
    assert sent.start["headers"] == [
        (b"content-type", b"application/json"),
        (b"set-cookie", b"a=1"),
        (b"set-cookie", b"b=2"),
        (b"x-gym-worker", b"w1"),
        (b"content-length", b"2"),
    ]
    assert sent.body == b"{}"


async def test_a_reply_head_larger_than_one_read_is_assembled(forwarder):
    big = b"v" * (stream_forwarder._READ_SIZE + 50_000)
    pool(
        forwarder,
        FakeConnection(b"HTTP/1.1 200 OK\r\nx-big: " + big + b"\r\ncontent-length: 0\r\n\r\n"),
    )
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.start["headers"] == [(b"x-big", big), (b"content-length", b"0")]
    assert sent.messages[1:] == [{"type": "http.response.body", "body": b"", "more_body": False}]


async def test_a_reply_to_head_has_no_body_whatever_its_length_says(forwarder):
    connection = FakeConnection(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
    connection.reader.feed_eof()  # were a body awaited, the hop would fail at EOF
    pool(forwarder, connection)
    sent = Sent()
    await forward(forwarder, sent, scope=make_scope(method="HEAD", path="/health"), body=b"")
    assert sent.messages == [
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"10")]},
        {"type": "http.response.body", "body": b"", "more_body": False},
    ]
    assert connection.written.startswith(b"HEAD /health HTTP/1.1\r\n")


async def test_a_204_reply_ends_without_a_body(forwarder):
    pool(forwarder, FakeConnection(b"HTTP/1.1 204 No Content\r\n\r\n"))
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.start["status"] == 204
    assert sent.messages[1:] == [{"type": "http.response.body", "body": b"", "more_body": False}]


# Whether a connection is used again -------------------------------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nConnection: Close\r\ncontent-length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok",
    ],
)
async def test_a_reply_that_ends_its_connection_is_not_pooled(forwarder, reply):
    connection = FakeConnection(reply)
    pool(forwarder, connection)
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.body == b"ok" and sent.finished
    assert connection.writer.closed
    assert pooled(forwarder) == []


async def test_an_http_1_0_keep_alive_reply_is_pooled(forwarder):
    connection = FakeConnection(
        b"HTTP/1.0 200 OK\r\nconnection: keep-alive\r\ncontent-length: 2\r\n\r\nok"
    )
    pool(forwarder, connection)
    await forward(forwarder, Sent())
    assert pooled(forwarder) == [connection.connection]


async def test_a_pooled_connection_carries_the_next_request(forwarder):
    connection = FakeConnection(OK_HELLO)
    pool(forwarder, connection)
    await forward(forwarder, Sent(), body=b"1")
    assert connection.connection.idle_timer is not None
    connection.reader.feed_data(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nbye")
    sent = Sent()
    await forward(forwarder, sent, body=b"2")
    assert sent.body == b"bye"
    assert connection.written.count(b"POST /step HTTP/1.1\r\n") == 2
    assert connection.written.endswith(b"\r\n\r\n2")
    assert pooled(forwarder) == [connection.connection]


async def test_closed_pooled_connections_are_skipped_and_closed(forwarder):
    good = FakeConnection(OK_HELLO)
    at_eof = FakeConnection()
    at_eof.reader.feed_eof()
    closing = FakeConnection()
    closing.writer.close()
    pool(forwarder, good, at_eof, closing)
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.body == b"hello"
    assert at_eof.writer.closed and at_eof.writer.writes == []
    assert closing.writer.writes == []
    assert good.writer.writes != []
    assert pooled(forwarder) == [good.connection]


async def test_the_pool_keeps_at_most_its_limit_and_close_empties_it(forwarder):
    limit = stream_forwarder._MAX_IDLE_PER_HOLDER
    connections = [FakeConnection() for _ in range(limit + 1)]
    for connection in connections:
        forwarder._release(WORKER, connection.connection)
    assert pooled(forwarder) == [c.connection for c in connections[:limit]]
    assert connections[-1].writer.closed
    assert not any(c.writer.closed for c in connections[:limit])
    await forwarder.close()
    assert forwarder._idle == {}
    assert all(c.writer.closed and c.connection.idle_timer is None for c in connections)


async def test_an_idle_connection_closes_and_leaves_the_pool(forwarder):
    first, second = FakeConnection(), FakeConnection()
    forwarder._release(WORKER, first.connection)
    forwarder._release(WORKER, second.connection)
    forwarder._close_idle(WORKER, first.connection)
    assert first.writer.closed and pooled(forwarder) == [second.connection]
    forwarder._close_idle(WORKER, second.connection)
    assert WORKER not in forwarder._idle


# Failures ------------------------------------------------------------------------------------


async def test_an_interim_reply_is_a_bad_gateway_and_ends_the_connection(forwarder):
    connection = FakeConnection(b"HTTP/1.1 100 Continue\r\n\r\n")
    pool(forwarder, connection)
    sent = Sent()
    with pytest.raises(BadGatewayError) as caught:
        await forward(forwarder, sent)
    assert caught.value.message == f"worker {WORKER} sent an interim reply"
    assert (caught.value.status, caught.value.code) == (502, "bad_gateway")
    assert sent.messages == []
    assert connection.writer.closed and pooled(forwarder) == []


async def test_eof_mid_body_ends_the_reply_unfinished_and_the_connection(forwarder):
    connection = FakeConnection(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
    connection.reader.feed_eof()
    pool(forwarder, connection)
    sent = Sent()
    with pytest.raises(EOFError, match="mid-reply"):
        await forward(forwarder, sent)
    assert sent.start["status"] == 200
    assert [(m["body"], m["more_body"]) for m in sent.messages[1:]] == [(b"half", True)]
    assert connection.writer.closed and pooled(forwarder) == []


async def test_a_malformed_chunk_mid_body_ends_the_connection(forwarder):
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    connection = FakeConnection(head + b"2\r\nok\r\n")
    pool(forwarder, connection)
    sent = Sent(feed=(connection, [b"zz\r\nnot a chunk\r\n"]))
    with pytest.raises(httptools.HttpParserError):
        await forward(forwarder, sent)
    assert [(m["body"], m["more_body"]) for m in sent.messages[1:]] == [(b"ok", True)]
    assert connection.writer.closed and pooled(forwarder) == []


async def test_a_cancelled_exchange_closes_its_connection(forwarder):
    request_sent = asyncio.Event()
    connection = FakeConnection(on_write=lambda data: request_sent.set())  # never answers
    pool(forwarder, connection)
    task = asyncio.ensure_future(forwarder.forward(WORKER, make_scope(), b"{}", Sent()))
    await request_sent.wait()  # the hop now waits for a reply that does not come
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert connection.writer.closed and pooled(forwarder) == []


async def test_a_claimant_without_a_socket_is_gone(forwarder):
    stale = FakeConnection()
    stale.reader.feed_eof()
    pool(forwarder, stale)
    with pytest.raises(SessionGoneError) as caught:
        await forward(forwarder, Sent())
    assert (caught.value.status, caught.value.code) == (410, "session_gone")
    assert caught.value.message == f"the worker that holds this session ({WORKER}) is gone"
    assert stale.writer.closed and WORKER not in forwarder._idle


async def test_a_pooled_connection_closed_by_a_gone_claimant_is_gone(forwarder):
    spare = FakeConnection()
    broken = FakeConnection()
    broken.writer.on_write = lambda data: broken.reader.feed_eof()
    pool(forwarder, spare, broken)
    with pytest.raises(SessionGoneError):
        await forward(forwarder, Sent())
    assert broken.writer.closed and spare.writer.closed
    assert WORKER not in forwarder._idle


# With a claimant on a real socket ------------------------------------------------------------


async def test_a_new_connection_is_opened_and_kept_for_the_next_request(forwarder, claimant):
    claimant.script += [
        (OK_HELLO, False),
        (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", False),
    ]
    first, second = Sent(), Sent()
    await forward(forwarder, first, body=b"one")
    await forward(forwarder, second, body=b"two")
    assert (first.body, second.body) == (b"hello", b"ok")
    assert [body for _, body in claimant.requests] == [b"one", b"two"]
    assert claimant.connections == 1
    assert len(pooled(forwarder)) == 1


async def test_after_connection_close_the_next_request_opens_another(forwarder, claimant):
    closing = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    claimant.script += [(closing, True), (OK_HELLO, False)]
    await forward(forwarder, Sent())
    assert pooled(forwarder) == []
    sent = Sent()
    await forward(forwarder, sent)
    assert sent.body == b"hello"
    assert claimant.connections == 2


async def test_a_pooled_connection_the_claimant_closed_is_resent_once_afresh(forwarder, claimant):
    claimant.script.append((OK_HELLO, False))
    stale = FakeConnection()
    stale.writer.on_write = lambda data: stale.reader.feed_eof()  # closed while idle
    pool(forwarder, stale)
    sent = Sent()
    await forward(forwarder, sent, body=b"the step")
    assert sent.body == b"hello" and sent.finished
    assert stale.writer.closed
    assert [body for _, body in claimant.requests] == [b"the step"]
    assert len(pooled(forwarder)) == 1 and pooled(forwarder)[0] is not stale.connection


async def test_a_new_connection_closed_before_replying_is_not_resent(forwarder, claimant):
    claimant.script.append((b"", True))
    with pytest.raises(BadGatewayError) as caught:
        await forward(forwarder, Sent(), body=b"once")
    assert caught.value.message.startswith(f"forwarding to worker {WORKER} failed: ")
    assert "closed the connection before replying" in caught.value.message
    assert [body for _, body in claimant.requests] == [b"once"]
    assert pooled(forwarder) == []


async def test_a_new_connection_closed_mid_head_is_not_resent(forwarder, claimant):
    claimant.script.append((b"HTTP/1.1 200 OK\r\ncontent-len", True))
    with pytest.raises(BadGatewayError):
        await forward(forwarder, Sent(), body=b"once")
    assert len(claimant.requests) == 1


async def test_a_reply_that_is_not_http_is_a_bad_gateway(forwarder, claimant):
    claimant.script.append((b"SSH-2.0-OpenSSH\r\n\r\n", True))
    sent = Sent()
    with pytest.raises(BadGatewayError) as caught:
        await forward(forwarder, sent)
    assert caught.value.message.startswith(f"forwarding to worker {WORKER} failed: HttpParser")
    assert sent.messages == []


async def test_a_resend_that_fails_too_is_a_bad_gateway(forwarder, claimant):
    claimant.script.append((b"", True))
    stale = FakeConnection()
    stale.writer.on_write = lambda data: stale.reader.feed_eof()
    pool(forwarder, stale)
    with pytest.raises(BadGatewayError):
        await forward(forwarder, Sent(), body=b"x")
    assert len(claimant.requests) == 1  # the resend, and no third try
    assert pooled(forwarder) == []


async def test_a_pooled_connection_that_broke_mid_head_is_not_resent(forwarder, claimant):
    claimant.script.append((OK_HELLO, False))
    answered = FakeConnection()

    def reply_partly_then_break(data: bytes) -> None:
        answered.reader.feed_data(b"HTTP/1.1 200 OK\r\ncontent-le")
        answered.reader.feed_eof()

    answered.writer.on_write = reply_partly_then_break
    pool(forwarder, answered)
    with pytest.raises(BadGatewayError):
        await forward(forwarder, Sent(), body=b"the step")
    assert claimant.requests == []  # the request the claimant answered is not run again


async def test_a_holder_that_dies_after_answering_the_probe_is_gone_never_refused(
    runtime_dir, claimant
):
    # The pooled connection closed unanswered because the holder exited, maybe
    # after running the request; its listener still took the reachability probe
    # (the process was mid-exit) and refuses the resend. "Refused" would mean
    # "never ran" and let a durable session be restored and the request run twice.
    class DiesAfterTheProbe(UnixEndpoints):
        async def reachable(self, worker_id: str) -> bool:
            answered = await super().reachable(worker_id)
            assert claimant.server is not None
            claimant.server.close()  # the exit reaches the listener
            await claimant.server.wait_closed()
            return answered

    hop = StreamForwarder(DiesAfterTheProbe(runtime_dir))
    ran = FakeConnection()
    ran.writer.on_write = lambda data: ran.reader.feed_eof()  # read it, then the exit's close
    hop._idle[WORKER] = deque([ran.connection])
    try:
        with pytest.raises(SessionGoneError) as caught:
            await forward(hop, Sent(), body=b"the step")
    finally:
        await hop.close()
    assert not isinstance(caught.value, HolderRefusedError)
    assert (caught.value.status, caught.value.code) == (410, "session_gone")
    assert claimant.requests == []  # nothing was resent
