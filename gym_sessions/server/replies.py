"""JSON replies as Starlette's ``JSONResponse`` makes them, with one encoder made once.

``JSONResponse.render`` calls ``json.dumps`` with options, which builds a new
``JSONEncoder`` for every reply; `JSONReply` encodes the same bytes (compact,
UTF-8, NaN and Infinity refused) with one encoder made at import.
`send_json_reply` sends those bytes with the same headers straight through an
ASGI ``send``, with no response object (the tool routes' fast path).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import Send

__all__ = ["JSONReply", "send_json_reply"]

_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


_CONTENT_TYPE = (b"content-type", b"application/json")


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
