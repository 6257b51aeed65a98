"""`CompressedReplies`: the worker that answers a client compresses its binary replies.

Around a worker's whole stack (the routing rule included), so a reply is
compressed once, where it leaves for the client, however it was made: here,
by the holder over a hop (whose chunks are collected first), or as a step
batch's merged reply. Requests over the private listener pass unchanged (the
hop carries plain bytes; the edge compresses). What is compressed and when:
`gym_sessions.compression`.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_sessions import compression
from gym_sessions.scope_keys import PRIVATE_SCOPE_KEY
from gym_sessions.value_messages import BINARY_TYPE

__all__ = ["CompressedReplies"]

_BINARY_TYPE = BINARY_TYPE.encode()
_ENCODING = compression.ENCODING.encode()


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key.lower() == name:
            return value
    return None


class CompressedReplies:
    """ASGI middleware: zstd for binary value replies a client accepts it for."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.enabled = compression.available()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            not self.enabled
            or scope["type"] != "http"
            or scope.get(PRIVATE_SCOPE_KEY, False)
            or not compression.accepts_zstd(_header(scope["headers"], b"accept-encoding"))
        ):
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _Compressing(send))


class _Compressing:
    """The ``send`` of one request: holds a binary reply until its last chunk, then sends it."""

    def __init__(self, send: Send) -> None:
        self.send = send
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = list(message.get("headers", ()))
            content_type = _header(headers, b"content-type") or b""
            if content_type.startswith(_BINARY_TYPE) and not _header(headers, b"content-encoding"):
                self.start = {**message, "headers": headers}
                return
        elif kind == "http.response.body" and self.start is not None:
            self.chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            await self._send_whole()
            return
        await self.send(message)

    async def _send_whole(self) -> None:
        assert self.start is not None
        body = b"".join(self.chunks)
        start, self.start, self.chunks = self.start, None, []
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"vary"]
        vary = _header(start["headers"], b"vary")
        headers.append((b"vary", vary + b", accept-encoding" if vary else b"accept-encoding"))
        if len(body) >= compression.MIN_SIZE:
            packed = compression.compress(body)
            if len(packed) < len(body):
                body = packed
                headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
                headers += [
                    (b"content-length", str(len(body)).encode()),
                    (b"content-encoding", _ENCODING),
                ]
        await self.send({**start, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
