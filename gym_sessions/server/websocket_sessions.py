"""``/ws``: a session's requests as the messages of one WebSocket (``docs/design.md`` §3.16).

`WebSocketSessions` is pure ASGI, outermost in a worker's stack. A
``websocket`` scope on ``/ws`` is accepted; every other scope passes through
unchanged. Each text message is one request envelope::

    {"id": 7, "method": "POST", "path": "/step", "body": {"action": 1},
     "headers": {"x-gym-episode-length": "3"}, "new_session": false}

and is served as the HTTP request it describes, through the worker's own stack
(metrics, then `SessionRouter`), so the routing rule, the ownership rule, the
body bounds, the conditional step and every error are the ones of HTTP: the
message reaches the session's holder over the hop when this worker does not
hold it, a gone holder is 410, a durable session is restored. Its reply is one
text message::

    {"id": 7, "status": 200, "headers": [["set-cookie", "..."]], "body": {...}}

The connection keeps the cookies of its upgrade request and sends them with
every request; a reply's ``Set-Cookie`` of the session cookie replaces it for
the requests that follow (and reaches the client, which reconnects with it).
``new_session`` drops the session cookie for that request, as an HTTP client
drops it on a session's first start. A message's own headers are only those of
`MESSAGE_HEADERS`: never a cookie or a token, so a connection speaks for the
session its cookie names and for no other. A session started here is started
on this worker (no balanced placement): it is then held where its messages
arrive and they need no hop.

Requests of a connection are served one at a time, in order. A client that
goes away is to the request in flight what an HTTP client's disconnect is
(§3.4.6): a ``/step`` ran or did not, and the client's next connection asks
``/observe``.

Frames that are not a request close the connection (`CloseCode`): binary
frames (this connection speaks JSON), a text that is not strict JSON or not an
envelope. Oversized messages (over ``max_message_bytes``) and protocol errors
(a reserved opcode) are closed by the WebSocket library itself, with 1009 and
1002, before they reach here. After a 410 reply the connection closes with
4410: the session is gone, and nothing more sent on it could reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import re
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_sessions import strict_json
from gym_sessions.scope_keys import STARTS_HERE_SCOPE_KEY
from gym_sessions.value_messages import BINARY_MEDIA_TYPE, BINARY_TYPE
from gym_sessions.wire import (
    CLOSE_FOLLOWS_HEADER,
    EPISODE_LENGTH_HEADER,
    SESSION_GONE_CLOSE_CODE,
    VALUES_SUBPROTOCOL,
    WEBSOCKET_PATH,
    route_path,
)

__all__ = ["MESSAGE_HEADERS", "VALUES_MESSAGE_HEADERS", "CloseCode", "WebSocketSessions"]

logger = logging.getLogger("gym_sessions.websocket")

#: The headers a request envelope may carry; the cookie comes from the connection.
MESSAGE_HEADERS = frozenset({EPISODE_LENGTH_HEADER, CLOSE_FOLLOWS_HEADER})
#: On a connection of `VALUES_SUBPROTOCOL`, also: the reply may be a binary message.
VALUES_MESSAGE_HEADERS = MESSAGE_HEADERS | {"accept"}

#: A binary frame: this many bytes (big-endian) give the envelope's length; the
#: envelope (JSON, without ``body``) follows, then the body: a binary values message.
_ENVELOPE_LENGTH_BYTES = 4

#: Paths a message may not name: they are not one session's, or their replies are not JSON.
_REFUSED_PATHS = frozenset({WEBSOCKET_PATH, "/metrics", "/step_batch", "/mcp", "/render"})

#: A request path: an absolute path of route characters, nothing else (no query, no dots).
_PATH = re.compile(r"/[A-Za-z0-9_\-/]{0,255}")

#: Envelopes read ahead of the request being served; then the socket is not read
#: (uvicorn pauses it): a connection holds at most about three messages (the one
#: served, one queued, one read), so bodies held outside the router's body budget
#: stay within a few ``max_body_bytes`` per connection. Reading on while a request
#: runs is what lets it see its client leave.
_READ_AHEAD = 1

#: A body as the router reads it (strict JSON); one encoder, not one per message.
_BODY_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))

#: A close reason is at most 123 bytes (RFC 6455, 5.5.1).
_MAX_REASON_BYTES = 123


class CloseCode(enum.IntEnum):
    """Close codes this endpoint sends (RFC 6455 7.4.1, and one of its own)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    #: A binary frame on a connection that speaks JSON.
    UNSUPPORTED_DATA = 1003
    #: A text frame that is not strict JSON, or not a request envelope.
    INVALID_PAYLOAD = 1007
    INTERNAL_ERROR = 1011
    #: 410: the session's holder has exited (or the server closed it for idling).
    SESSION_GONE = SESSION_GONE_CLOSE_CODE


class _BadEnvelope(Exception):
    pass


def _reason(text: str) -> str:
    data = text.encode()
    if len(data) <= _MAX_REASON_BYTES:
        return text
    return data[: _MAX_REASON_BYTES - 3].decode(errors="ignore") + "..."


_Envelope = tuple[int, str, str, bytes, list[tuple[bytes, bytes]], bool]


def _binary_envelope(data: bytes) -> _Envelope:
    """A binary frame's envelope, with its binary body (and that body's content type)."""
    head_size = int.from_bytes(data[:_ENVELOPE_LENGTH_BYTES], "big")
    end = _ENVELOPE_LENGTH_BYTES + head_size
    if len(data) < end:
        raise _BadEnvelope("a binary frame's envelope length runs past its end")
    try:
        text = data[_ENVELOPE_LENGTH_BYTES:end].decode()
    except UnicodeDecodeError:
        raise _BadEnvelope("a binary frame's envelope is not UTF-8") from None
    request_id, method, path, body, headers, new_session = _envelope(text, VALUES_MESSAGE_HEADERS)
    if body:
        raise _BadEnvelope("a binary frame's body follows its envelope, not inside it")
    headers.append((b"content-type", BINARY_MEDIA_TYPE.encode()))
    return request_id, method, path, data[end:], headers, new_session


def _envelope(text: str, allowed: frozenset[str]) -> _Envelope:
    """``(id, method, path, body, headers, new_session)`` of a request envelope."""
    try:
        message = strict_json.loads(text)
    except ValueError as exc:
        raise _BadEnvelope(f"not strict JSON: {exc}") from None
    if not isinstance(message, dict):
        raise _BadEnvelope("a message must be a JSON object")
    request_id = message.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise _BadEnvelope("a message needs an integer 'id'")
    method = message.get("method", "POST")
    if method not in ("GET", "POST"):
        raise _BadEnvelope("'method' must be GET or POST")
    path = message.get("path")
    if not isinstance(path, str) or not _PATH.fullmatch(path):
        raise _BadEnvelope("'path' must be a route path such as /step")
    if route_path(path) in _REFUSED_PATHS:
        raise _BadEnvelope(f"{path} is not served over {WEBSOCKET_PATH}: use HTTP")
    headers: list[tuple[bytes, bytes]] = []
    extra = message.get("headers", {})
    if not isinstance(extra, dict):
        raise _BadEnvelope("'headers' must be an object")
    for name, value in extra.items():
        if name.lower() not in allowed or not isinstance(value, str):
            raise _BadEnvelope(f"header {name!r} may not be sent in a message")
        headers.append((name.lower().encode(), value.encode()))
    new_session = message.get("new_session", False)
    if not isinstance(new_session, bool):
        raise _BadEnvelope("'new_session' must be true or false")
    body = b""
    if "body" in message and message["body"] is not None:
        body = _BODY_ENCODER.encode(message["body"]).encode()
    return request_id, method, path, body, headers, new_session


class _Cookies:
    """The cookies a connection sends: its upgrade's, the session cookie kept up to date."""

    def __init__(self, header: bytes, name: str) -> None:
        self.name = name
        self.others: list[str] = []
        self.session: str | None = None
        for part in header.decode("latin-1").split(";"):
            key, sep, value = part.strip().partition("=")
            if not sep:
                continue
            if key == name:
                self.session = value
            else:
                self.others.append(f"{key}={value}")

    def header(self, new_session: bool) -> bytes | None:
        parts = list(self.others)
        if self.session is not None and not new_session:
            parts.append(f"{self.name}={self.session}")
        return "; ".join(parts).encode("latin-1") if parts else None

    def take(self, headers: list[tuple[bytes, bytes]]) -> None:
        """Keep the session cookie a reply sets."""
        for name, value in headers:
            if name == b"set-cookie":
                key, _, rest = value.decode("latin-1").split(";", 1)[0].partition("=")
                if key.strip() == self.name:
                    self.session = rest.strip() or None


class _Connection:
    """One accepted WebSocket: reads envelopes ahead, serves them one by one."""

    def __init__(
        self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, cookie: str, values: bool
    ) -> None:
        self.app = app
        #: `VALUES_SUBPROTOCOL` was negotiated: binary frames are requests too.
        self.values = values
        self.allowed = VALUES_MESSAGE_HEADERS if values else MESSAGE_HEADERS
        self.scope = scope
        self.receive = receive
        self.send = send
        cookie_header = b"; ".join(v for k, v in scope["headers"] if k == b"cookie")
        self.cookies = _Cookies(cookie_header, cookie)
        #: Frames read, in order; ``None`` once the connection ends.
        self.queue: asyncio.Queue[str | bytes | None] = asyncio.Queue()
        #: Frames being served or queued, at most one more than the one served.
        self.room = asyncio.Semaphore(_READ_AHEAD + 1)
        #: Set once the client has gone (or the connection is being closed).
        self.gone = asyncio.Event()
        self.closed = False

    async def run(self) -> bool:
        """Serve the connection until it ends; ``False`` if the endpoint itself failed."""
        reader = asyncio.create_task(self._read())
        server = asyncio.create_task(self._serve())
        try:
            await asyncio.wait({reader, server}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The request in flight is never cancelled from here: it sees a
            # disconnect, as an HTTP client's would (starts, closes and /verify
            # run to completion, a /step ran or did not), and ends as that allows.
            self._end()
            reader.cancel()
            await asyncio.shield(asyncio.gather(reader, server, return_exceptions=True))
        failed = False
        for task in (reader, server):
            if not task.cancelled() and task.exception() is not None:
                logger.error("websocket task failed", exc_info=task.exception())
                failed = True
        return not failed

    def _end(self) -> None:
        if not self.gone.is_set():
            self.gone.set()
            self.queue.put_nowait(None)  # wakes the serving loop

    async def close(self, code: int, reason: str) -> None:
        self._end()
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):  # the client may have gone already
            await self.send({"type": "websocket.close", "code": code, "reason": _reason(reason)})

    async def _read(self) -> None:
        while True:
            await self.room.acquire()
            message = await self.receive()
            kind = message["type"]
            if kind == "websocket.disconnect":
                self.closed = True
                self._end()
                return
            if kind != "websocket.receive":
                self.room.release()
                continue
            text = message.get("text")
            if text is None and not self.values:
                await self.close(
                    CloseCode.UNSUPPORTED_DATA,
                    "binary frame refused: this connection speaks JSON text messages "
                    f"(binary frames need the {VALUES_SUBPROTOCOL} subprotocol)",
                )
                return
            self.queue.put_nowait(text if text is not None else message.get("bytes") or b"")

    async def _serve(self) -> None:
        while True:
            frame = await self.queue.get()
            if frame is None or self.gone.is_set():
                return
            try:
                if isinstance(frame, str):
                    request = _envelope(frame, self.allowed)
                else:
                    request = _binary_envelope(frame)
            except _BadEnvelope as exc:
                await self.close(CloseCode.INVALID_PAYLOAD, f"bad message: {exc}")
                return
            try:
                gone = await self._serve_one(*request)
            finally:
                self.room.release()
            if gone is not None:
                await self.close(CloseCode.SESSION_GONE, gone)
                return

    async def _serve_one(
        self,
        request_id: int,
        method: str,
        path: str,
        body: bytes,
        extra: list[tuple[bytes, bytes]],
        new_session: bool,
    ) -> str | None:
        """Serve one message's request and send its reply; a 410's close reason, if it was one."""
        headers = [(b"host", _header(self.scope, b"host") or b"localhost"), *extra]
        if not any(name == b"accept" for name, _ in extra):
            headers.append((b"accept", b"application/json"))
        if body and not any(name == b"content-type" for name, _ in extra):
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(body)).encode()))
        cookie = self.cookies.header(new_session)
        if cookie is not None:
            headers.append((b"cookie", cookie))
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": method,
            "scheme": "https" if self.scope.get("scheme") == "wss" else "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": self.scope.get("root_path", ""),
            "headers": headers,
            "client": self.scope.get("client"),
            "server": self.scope.get("server"),
            STARTS_HERE_SCOPE_KEY: True,
        }
        if "state" in self.scope:
            scope["state"] = dict(self.scope["state"])
        sent_body = False

        async def receive() -> Message:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        status = 500
        reply_headers: list[tuple[bytes, bytes]] = []
        chunks: list[bytes] = []

        async def send(message: Message) -> None:
            nonlocal status, reply_headers
            if message["type"] == "http.response.start":
                status = message["status"]
                reply_headers = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, send)
        self.cookies.take(reply_headers)
        reply = b"".join(chunks)
        await self._reply(request_id, status, reply_headers, reply)
        return _gone_reason(reply) if status == 410 else None

    async def _reply(
        self, request_id: int, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        content_type = b""
        shown: list[list[str]] = []
        for name, value in headers:
            if name == b"content-type":
                content_type = value
            if name in (b"content-length", b"connection"):
                continue
            shown.append([name.decode("latin-1"), value.decode("latin-1")])
        head = json.dumps({"id": request_id, "status": status, "headers": shown})
        if content_type.startswith(BINARY_TYPE.encode()):
            # Asked for in `accept`, so on a values connection: a binary frame.
            envelope = head.encode()
            length = len(envelope).to_bytes(_ENVELOPE_LENGTH_BYTES, "big")
            if not self.closed:
                with contextlib.suppress(Exception):
                    await self.send({"type": "websocket.send", "bytes": length + envelope + body})
            return
        if not body:
            payload = head[:-1] + ',"body":null}'
        elif content_type.startswith(b"application/json"):
            # The reply is strict JSON already: spliced in, not parsed and written again.
            payload = head[:-1] + ',"body":' + body.decode() + "}"
        else:
            payload = head[:-1] + ',"body":' + json.dumps(body.decode(errors="replace")) + "}"
        if self.closed:
            return
        with contextlib.suppress(Exception):  # gone: the client's next connection asks
            await self.send({"type": "websocket.send", "text": payload})


def _gone_reason(body: bytes) -> str:
    """``<code>: <message>`` of a 410's error body (``session_gone``, ``session_expired``)."""
    try:
        error = json.loads(body)["error"]
        return f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return "session_gone: the session is gone"


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


class WebSocketSessions:
    """Pure ASGI: a WebSocket on ``/ws`` carries one client's session requests.

    Args:
        app: The worker's stack; each message is served as an HTTP request by it.
        cookie_name: The server's session cookie name.
    """

    def __init__(self, app: ASGIApp, cookie_name: str) -> None:
        self.app = app
        self.cookie_name = cookie_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            await self.app(scope, receive, send)
            return
        first = await receive()
        if first["type"] != "websocket.connect":
            return
        if scope["path"] != WEBSOCKET_PATH:
            # Refused before accepting: the client sees a 403 to its upgrade.
            await send({"type": "websocket.close", "code": 1008, "reason": "no such endpoint"})
            return
        values = VALUES_SUBPROTOCOL in scope.get("subprotocols", ())
        accept: dict[str, Any] = {"type": "websocket.accept"}
        if values:
            accept["subprotocol"] = VALUES_SUBPROTOCOL
        await send(accept)
        connection = _Connection(self.app, scope, receive, send, self.cookie_name, values)
        if await connection.run():
            await connection.close(CloseCode.NORMAL, "")
        else:
            await connection.close(CloseCode.INTERNAL_ERROR, "internal_error (logged)")
