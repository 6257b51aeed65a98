"""`WebSocketSessions` in process: what each message becomes as an HTTP request (§3.16).

The app inside is a real ASGI app that echoes what it was asked, so these
tests see the scope, headers and body a message is served with, and the reply
message each HTTP reply becomes.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gym_sessions.scope_keys import STARTS_HERE_SCOPE_KEY
from gym_sessions.server.websocket_sessions import WebSocketSessions

SET_COOKIE = b"gym_session=second; path=/; httponly"


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Replies with what it got; ``/set`` also sets a new session cookie."""
    message = await receive()
    headers = {name.decode(): value.decode() for name, value in scope["headers"]}
    body = json.dumps(
        {
            "method": scope["method"],
            "path": scope["path"],
            "headers": headers,
            "body": message["body"].decode(),
            "starts_here": scope.get(STARTS_HERE_SCOPE_KEY, False),
        }
    ).encode()
    reply_headers = [(b"content-type", b"application/json")]
    if scope["path"] == "/set":
        reply_headers.append((b"set-cookie", SET_COOKIE))
    status = 410 if scope["path"] == "/gone" else 200
    if status == 410:
        body = b'{"error": {"code": "session_expired", "message": "closed for idling"}}'
    await send({"type": "http.response.start", "status": status, "headers": reply_headers})
    await send({"type": "http.response.body", "body": body})


class Socket:
    """One WebSocket as uvicorn hands it to an app, driven from the test."""

    def __init__(self, path: str = "/ws", cookie: bytes | None = None) -> None:
        headers = [(b"host", b"test")]
        if cookie is not None:
            headers.append((b"cookie", cookie))
        self.scope = {"type": "websocket", "path": path, "headers": headers, "subprotocols": []}
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.incoming.put_nowait({"type": "websocket.connect"})
        app = WebSocketSessions(echo, "gym_session")
        self.task = asyncio.create_task(app(self.scope, self.incoming.get, self.outgoing.put))

    async def request(self, **envelope: Any) -> dict[str, Any]:
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(envelope)})
        message = await self.sent()
        assert message["type"] == "websocket.send", message
        return dict(json.loads(message["text"]))

    async def sent(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.outgoing.get(), 5)

    async def leave(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(self.task, 5)


async def test_a_message_is_served_as_its_request_with_the_connections_cookies():
    socket = Socket(cookie=b"other=1; gym_session=first")
    assert (await socket.sent())["type"] == "websocket.accept"
    reply = await socket.request(
        id=3, path="/step", body={"action": 1}, headers={"x-gym-episode-length": "2"}
    )
    assert reply["id"] == 3 and reply["status"] == 200
    seen = reply["body"]
    assert seen["method"] == "POST" and seen["path"] == "/step"
    assert json.loads(seen["body"]) == {"action": 1}
    assert seen["headers"]["cookie"] == "other=1; gym_session=first"
    assert seen["headers"]["x-gym-episode-length"] == "2"
    assert seen["headers"]["content-type"] == "application/json"
    assert seen["starts_here"] is True
    await socket.leave()


async def test_a_replys_cookie_is_sent_from_then_on_and_new_session_drops_it():
    socket = Socket(cookie=b"gym_session=first")
    await socket.sent()
    reply = await socket.request(id=1, path="/set", body={})
    assert ["set-cookie", SET_COOKIE.decode()] in reply["headers"]
    after = await socket.request(id=2, path="/observe", body={})
    assert after["body"]["headers"]["cookie"] == "gym_session=second"
    fresh = await socket.request(id=3, path="/reset", body={}, new_session=True)
    assert "cookie" not in fresh["body"]["headers"]
    await socket.leave()


async def test_a_410_reply_is_sent_then_the_connection_closes_4410():
    socket = Socket()
    await socket.sent()
    reply = await socket.request(id=1, path="/gone", body={})
    assert reply["status"] == 410
    closing = await socket.sent()
    assert closing["type"] == "websocket.close" and closing["code"] == 4410
    assert closing["reason"] == "session_expired: closed for idling"
    await asyncio.wait_for(socket.task, 5)


async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    raise RuntimeError("a reply that cannot be finished")


async def test_an_endpoint_failure_closes_1011():
    incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    incoming.put_nowait({"type": "websocket.connect"})
    scope = {"type": "websocket", "path": "/ws", "headers": [], "subprotocols": []}
    task = asyncio.create_task(
        WebSocketSessions(failing, "gym_session")(scope, incoming.get, outgoing.put)
    )
    assert (await outgoing.get())["type"] == "websocket.accept"
    incoming.put_nowait({"type": "websocket.receive", "text": '{"id": 1, "path": "/step"}'})
    closing = await asyncio.wait_for(outgoing.get(), 5)
    assert closing["type"] == "websocket.close" and closing["code"] == 1011
    await asyncio.wait_for(task, 5)


async def test_refused_envelopes_close_1007_without_a_request():
    for envelope in [
        {"id": 1, "path": "/step", "headers": {"cookie": "gym_session=x"}},
        {"id": 1, "path": "/step", "headers": {"x-gym-session-token": "t"}},
        {"id": 1, "path": "/step", "headers": {"accept": "application/json"}},  # JSON connection
        {"id": 1, "path": "/step_batch"},
        {"id": 1, "path": "/step?x=1"},
        {"id": True, "path": "/step"},
        {"id": 1, "path": "/step", "method": "DELETE"},
        {"id": 1, "path": "/step", "new_session": "yes"},
    ]:
        socket = Socket()
        await socket.sent()
        socket.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(envelope)})
        closing = await socket.sent()
        assert closing["type"] == "websocket.close", envelope
        assert closing["code"] == 1007, envelope
        assert len(closing["reason"].encode()) <= 123
        await asyncio.wait_for(socket.task, 5)


async def test_an_upgrade_to_another_path_is_refused_before_accepting():
    socket = Socket(path="/other")
    closing = await socket.sent()
    assert closing["type"] == "websocket.close"
    await asyncio.wait_for(socket.task, 5)
