"""`CoalescedCycle`: a reply's head leaves in the same write as its first body bytes.

`BoundedHttpProtocol` is driven here as uvicorn's server drives it, over a
transport that records each write (the socket's side is uvicorn's and the
kernel's); the apps are plain ASGI callables.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from gym_sessions.transport.http_protocol import BoundedHttpProtocol

pytestmark = pytest.mark.skipif(
    not BoundedHttpProtocol.coalesces_replies, reason="this uvicorn's cycle is not coalesced"
)

REQUEST = b"POST /step HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
BODY = b'{"observation":1}'
HEAD = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(BODY))]


class RecordingTransport(asyncio.Transport):
    """What the protocol writes, one entry per ``write`` call, and whether it closed."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        #: The buffers of each ``writelines`` call (each also one entry of `writes`).
        self.vectored: list[list[Any]] = []
        self.closed = False
        self.closed_by_server = False
        self.writes_at_close: int | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def writelines(self, list_of_data: Any) -> None:
        assert not self.closed, "written after close"
        buffers = list(list_of_data)
        self.vectored.append(buffers)
        self.writes.append(b"".join(buffers))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writes_at_close = len(self.writes)

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)


def connect(app: Any) -> tuple[BoundedHttpProtocol, RecordingTransport]:
    """A new connection of the protocol serving ``app``, as uvicorn's server makes one."""
    config = uvicorn.Config(app, lifespan="off", log_level="critical")
    protocol = BoundedHttpProtocol(
        config=config,
        server_state=ServerState(),
        app_state={},
        max_head_bytes=64 * 1024,
        head_timeout=30.0,
    )
    transport = RecordingTransport()
    protocol.connection_made(transport)
    return protocol, transport


async def serve(app: Any, *requests: bytes) -> RecordingTransport:
    """Feed ``requests`` (one read each) to a fresh connection; returns once every reply is done."""
    protocol, transport = connect(app)
    for request in requests:
        protocol.data_received(request)
        for _ in range(100):
            await asyncio.sleep(0)
            if protocol.cycle is not None and protocol.cycle.response_complete:
                break
        assert protocol.cycle.response_complete
    transport.closed_by_server = transport.closed
    protocol.connection_lost(None)
    return transport


async def json_reply(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": HEAD})
    await send({"type": "http.response.body", "body": BODY})


async def test_a_reply_in_two_messages_is_one_write():
    transport = await serve(json_reply, REQUEST, REQUEST)  # kept alive: two requests
    assert len(transport.writes) == 2
    for write in transport.writes:
        head, _, body = write.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"content-length: %d" % len(BODY) in head
        assert body == BODY
    assert not transport.closed_by_server


LARGE_BODY = bytes(range(256)) * 1024  # 256 KiB: a step batch of Pong frames


async def large_reply(scope: Any, receive: Any, send: Any) -> None:
    await receive()
    length = (b"content-length", b"%d" % len(LARGE_BODY))
    await send({"type": "http.response.start", "status": 200, "headers": [length]})
    await send({"type": "http.response.body", "body": LARGE_BODY})


async def test_a_large_body_goes_with_its_head_in_one_vectored_write_uncopied():
    transport = await serve(large_reply, REQUEST, REQUEST)
    assert len(transport.writes) == 2
    assert len(transport.vectored) == 2
    for write, (head, body) in zip(transport.writes, transport.vectored, strict=True):
        assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
        assert body is LARGE_BODY  # the app's own bytes, not a copy behind the head
        assert write == head + LARGE_BODY


async def test_a_small_body_is_not_a_vectored_write():
    transport = await serve(json_reply, REQUEST)
    assert len(transport.writes) == 1
    assert transport.vectored == []


async def test_a_head_waits_no_longer_than_the_apps_first_suspension():
    seen_before_body: list[list[bytes]] = []
    transport_box: list[RecordingTransport] = []

    async def slow_body(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": HEAD})
        await asyncio.sleep(0.01)  # a streamed reply waiting for its first chunk
        seen_before_body.append(list(transport_box[0].writes))
        await send({"type": "http.response.body", "body": BODY})

    protocol, transport = connect(slow_body)
    transport_box.append(transport)
    protocol.data_received(REQUEST)
    for _ in range(200):
        await asyncio.sleep(0.001)
        if protocol.cycle.response_complete:
            break
    protocol.connection_lost(None)
    (before,) = seen_before_body
    assert len(before) == 1 and before[0].endswith(b"\r\n\r\n")  # the head, alone, in time
    assert transport.writes == [before[0], BODY]


async def test_a_streamed_reply_sends_its_head_with_the_first_chunk():
    async def chunks(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    transport = await serve(chunks, REQUEST)
    first, second, last = transport.writes
    head, _, body = first.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head
    assert body == b"3\r\none\r\n"
    assert second == b"3\r\ntwo\r\n"
    assert last == b"0\r\n\r\n"


async def test_a_closing_reply_is_written_before_the_close():
    async def closing(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        headers = [*HEAD, (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": BODY})

    transport = await serve(closing, REQUEST)
    (write,) = transport.writes
    assert write.startswith(b"HTTP/1.1 413 ") and write.endswith(BODY)
    assert transport.closed and transport.writes_at_close == 1


async def test_an_app_failing_after_its_start_still_sends_the_head_then_closes():
    async def fails(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": HEAD})
        await send({"type": "http.response.start", "status": 200, "headers": HEAD})  # invalid

    protocol, transport = connect(fails)
    protocol.data_received(REQUEST)
    for _ in range(100):
        await asyncio.sleep(0)
        if transport.closed:
            break
    protocol.connection_lost(None)
    (write,) = transport.writes  # as uvicorn: the head went out, then the connection closed
    assert write.startswith(b"HTTP/1.1 200 OK\r\n") and write.endswith(b"\r\n\r\n")
    assert transport.closed and transport.writes_at_close == 1


def test_private_listeners_write_a_hops_reply_head_first():
    from gym_sessions.transport.private_listener import PrivateHttpProtocol

    assert not PrivateHttpProtocol.coalesces_replies


async def test_a_head_request_gets_its_head_alone_and_the_connection_stays():
    head_request = b"HEAD /step HTTP/1.1\r\nHost: x\r\n\r\n"
    transport = await serve(json_reply, head_request, REQUEST)
    first, second = transport.writes  # uvicorn writes no body for HEAD: the head goes alone
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\n")
    assert b"content-length: %d" % len(BODY) in first
    assert second.endswith(b"\r\n\r\n" + BODY)
    assert not transport.closed_by_server
