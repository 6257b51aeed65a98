"""JSON replies as Starlette's ``JSONResponse`` makes them, with one encoder made once.

``JSONResponse.render`` calls ``json.dumps`` with options, which builds a new
``JSONEncoder`` for every reply; `JSONReply` encodes the same bytes (compact,
UTF-8, NaN and Infinity refused) with one encoder made at import.
`send_json_reply` sends those bytes with the same headers straight through an
ASGI ``send``, with no response object (the tool routes' fast path).

Replies that carry space values (`gym_sessions.value_messages.SpaceValue`) go
out in the encoding the request asked for: `send_value_reply` and
`value_response` write exactly that JSON by default, a binary message on request.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse, Response
from starlette.types import Send

from gym_sessions.value_messages import (
    BINARY_MEDIA_TYPE,
    Encoding,
    ValuePositions,
    encode_message,
    json_content,
)

__all__ = [
    "JSONReply",
    "send_json_reply",
    "send_value_reply",
    "value_response",
]

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


_CONTENT_TYPE = (b"content-type", b"application/json")
_BINARY_CONTENT_TYPE = (b"content-type", BINARY_MEDIA_TYPE.encode())


class JSONReply(JSONResponse):
    """A JSON reply, byte for byte as ``JSONResponse`` renders it."""

    def render(self, content: Any) -> bytes:
        return _ENCODER.encode(content).encode("utf-8")


async def send_json_reply(send: Send, content: Any) -> None:
    """Send a 200 reply of ``content``: the messages ``JSONReply(content)`` would send."""
    body = _ENCODER.encode(content).encode("utf-8")  # before anything is sent: may raise
    headers = [(b"content-length", str(len(body)).encode("latin-1")), _CONTENT_TYPE]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_value_reply(
    send: Send, content: Any, encoding: Encoding, positions: ValuePositions
) -> None:
    """Send a 200 reply of ``content``, its space values at ``positions`` in ``encoding``."""
    if encoding is Encoding.JSON:
        await send_json_reply(send, json_content(content, positions))
        return
    body = encode_message(content, positions)
    headers = [(b"content-length", str(len(body)).encode("latin-1")), _BINARY_CONTENT_TYPE]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def value_response(content: Any, encoding: Encoding, positions: ValuePositions) -> Response:
    """``content`` as a response, its space values at ``positions`` in ``encoding``.

    In JSON, the bytes and headers ``JSONResponse`` gives the JSON content.
    """
    if encoding is Encoding.JSON:
        return JSONResponse(json_content(content, positions))
    return Response(encode_message(content, positions), media_type=BINARY_MEDIA_TYPE)
