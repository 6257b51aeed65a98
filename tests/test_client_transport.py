"""Both HTTP shells meet socket failures the same way, against a scripted in-process server.

Each request the server reads gets the next scripted answer: a JSON reply, a
closed connection (the reply is lost) or silence (no reply in time). The
blocking `HTTPClient` and the aiohttp `AsyncHTTPClient` must raise the same
errors and resend the same requests, since both leave the decision to
`gym_sessions.client.exchange`.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from websockets.asyncio.server import serve

from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.async_websocket import AsyncWebSocketClient
from gym_sessions.client.connection_pool import ConnectionPool
from gym_sessions.client.exchange import Reply, Request
from gym_sessions.client.http import HTTPClient
from gym_sessions.errors import (
    BadGatewayError,
    BadUpstreamError,
    ConnectionLostError,
    ReplyTimeoutError,
    ServerUnreachableError,
)
from gym_sessions.wire import VALUES_SUBPROTOCOL

RESENDABLE = Request("POST", "/observe", {}, resendable=True)
NOT_RESENDABLE = Request("POST", "/step", {"action": 1})
BODY = b'{"ok": 1}'
REPLY = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    b"Set-Cookie: gym_session=abc; Path=/\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
)


def _error_reply(code: str, message: str) -> bytes:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )


#: The answers besides ``reply``: what a worker answers when the hop to the
#: session's holder broke (a lost reply), and when an upstream answered unusably.
ERROR_REPLIES = {
    "gateway": _error_reply("bad_gateway", "the holder exited"),
    "upstream": _error_reply("bad_upstream", "the env server answered nonsense"),
}


class ScriptedServer:
    """Answers each request with the next of ``script``: ``reply``, ``gateway`` or
    ``upstream`` (our 502s), ``close`` or ``hold``."""

    def __init__(self, script: list[str]) -> None:
        self.script = list(script)
        self.requests: list[bytes] = []
        self.stopped = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            buffered = b""
            while True:
                while b"\r\n\r\n" not in buffered:
                    data = connection.recv(65536)
                    if not data:
                        return
                    buffered += data
                head, _, buffered = buffered.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buffered) < length:
                    buffered += connection.recv(65536)
                buffered = buffered[length:]
                self.requests.append(head.split(b"\r\n", 1)[0])
                answer = self.script.pop(0) if self.script else "reply"
                if answer == "close":
                    return
                if answer == "hold":
                    self.stopped.wait()
                    return
                connection.sendall(ERROR_REPLIES.get(answer, REPLY))

    def close(self) -> None:
        self.stopped.set()
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self.listener.close()
        for thread in self.threads:
            thread.join(5)


@pytest.fixture
def scripted() -> Iterator:
    made: list[ScriptedServer] = []

    def make(*script: str) -> ScriptedServer:
        made.append(ScriptedServer(list(script)))
        return made[-1]

    yield make
    for server in made:
        server.close()


def free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def send_sync(url: str, request: Request, **options) -> Reply:
    client = HTTPClient(url, **options)
    try:
        return client.send(request)
    finally:
        client.close()


def send_async(url: str, request: Request, **options) -> Reply:
    async def main() -> Reply:
        client = AsyncHTTPClient(url, **options)
        try:
            return await client.send(request)
        finally:
            await client.close()

    return asyncio.run(main())


SHELLS = pytest.mark.parametrize("send", [send_sync, send_async], ids=["sync", "async"])


@SHELLS
def test_a_reply_comes_back_with_its_cookie(scripted, send):
    server = scripted("reply")
    reply = send(server.url, RESENDABLE)
    assert reply.json() == {"ok": 1}
    assert reply.headers["set-cookie"].startswith("gym_session=abc")


@SHELLS
def test_a_closed_port_is_unreachable_and_not_retried(send):
    url = free_url()
    with pytest.raises(ServerUnreachableError, match=url):
        send(url, RESENDABLE, retries=3)


#: The two ways a reply is lost: the connection breaks, or the worker that took
#: the request lost its hop to the session's holder (502 bad_gateway: the
#: holder died mid-request; with durable sessions a resend finds it restored).
LOST = pytest.mark.parametrize(
    ("lost", "raised"),
    [("close", ConnectionLostError), ("gateway", BadGatewayError)],
    ids=["connection_broke", "bad_gateway"],
)


@SHELLS
@LOST
def test_a_lost_reply_of_a_resendable_request_is_sent_again(scripted, send, lost, raised):
    server = scripted(lost, "reply")
    assert send(server.url, RESENDABLE).json() == {"ok": 1}
    assert server.requests == [b"POST /observe HTTP/1.1"] * 2


@SHELLS
@LOST
def test_a_lost_reply_of_any_other_request_is_raised(scripted, send, lost, raised):
    # A /step is never resent blindly: StepRecovery asks /observe whether it ran.
    server = scripted(lost, "reply")
    with pytest.raises(raised, match="POST /step" if lost == "close" else "the holder exited"):
        send(server.url, NOT_RESENDABLE)
    assert len(server.requests) == 1


@SHELLS
@LOST
def test_retries_run_out(scripted, send, lost, raised):
    server = scripted(lost, lost, lost, "reply")
    with pytest.raises(raised, match="POST /observe" if lost == "close" else "the holder exited"):
        send(server.url, RESENDABLE, retries=2)
    assert len(server.requests) == 3


@SHELLS
def test_lost_replies_of_every_kind_draw_on_one_budget_of_retries(scripted, send):
    server = scripted("close", "gateway", "reply")
    with pytest.raises(BadGatewayError):
        send(server.url, RESENDABLE, retries=1)
    assert len(server.requests) == 2


@SHELLS
def test_an_upstreams_unusable_answer_is_not_resent(scripted, send):
    # 502 bad_upstream: the env or model server did answer, and would again.
    server = scripted("upstream", "reply")
    with pytest.raises(BadUpstreamError, match="nonsense"):
        send(server.url, RESENDABLE)
    assert len(server.requests) == 1


@SHELLS
def test_no_reply_in_time_raises_reply_timeout(scripted, send):
    server = scripted("hold")
    with pytest.raises(ReplyTimeoutError, match=r"POST /step .* within 0\.3 s"):
        send(server.url, NOT_RESENDABLE, timeout=0.3)
    assert len(server.requests) == 1


def test_an_async_client_on_a_shared_pool_leaves_the_pool_open_and_names_its_timeout(scripted):
    server = scripted("reply", "hold")

    async def main() -> None:
        pool = ConnectionPool(server.url, timeout=0.3)
        client = AsyncHTTPClient(server.url, pool=pool)
        assert (await client.send(RESENDABLE)).json() == {"ok": 1}
        assert client.cookie == "abc"
        with pytest.raises(ReplyTimeoutError, match=r"within 0\.3 s"):
            await client.send(NOT_RESENDABLE)
        await client.close()
        # Still open: another session's request goes through it.
        other = AsyncHTTPClient(server.url, pool=pool)
        assert (await other.send(RESENDABLE)).json() == {"ok": 1}
        await pool.close()
        # The pool's owner picks the transport, TLS included.
        tls = ConnectionPool("https://example.org")
        client = AsyncHTTPClient("https://example.org", pool=tls)
        assert client.url == "https://example.org" and client.ssl_context is tls.ssl_context

    asyncio.run(main())


async def _over_websocket(script: list[str], request: Request) -> tuple[Reply | Exception, list]:
    """``request`` sent by the WebSocket shell to a server answering envelopes by ``script``."""
    paths: list[str] = []

    async def answer(connection) -> None:
        async for message in connection:
            envelope = json.loads(message)
            paths.append(envelope["path"])
            if (script.pop(0) if script else "reply") == "gateway":
                status, body = 502, {"error": {"code": "bad_gateway", "message": "holder exited"}}
            else:
                status, body = 200, {"ok": 1}
            headers = [["content-type", "application/json"]]
            reply = {"id": envelope["id"], "status": status, "headers": headers, "body": body}
            await connection.send(json.dumps(reply))

    async with serve(answer, "127.0.0.1", 0, subprotocols=[VALUES_SUBPROTOCOL]) as server:
        port = server.sockets[0].getsockname()[1]
        client = AsyncWebSocketClient(f"http://127.0.0.1:{port}", timeout=5)
        try:
            outcome: Reply | Exception = await client.send(request)
        except Exception as error:  # the outcome under test
            outcome = error
        finally:
            await client.close()
    return outcome, paths


async def test_the_websocket_shell_resends_on_a_502_as_the_http_shells_do():
    reply, paths = await _over_websocket(["gateway", "reply"], RESENDABLE)
    assert isinstance(reply, Reply) and reply.json() == {"ok": 1}
    assert paths == ["/observe", "/observe"]
    error, paths = await _over_websocket(["gateway", "reply"], NOT_RESENDABLE)
    assert isinstance(error, BadGatewayError) and paths == ["/step"]
