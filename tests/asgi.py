"""One HTTP request through an ASGI app in process, handed over as uvicorn hands it.

The body comes in one ``http.request`` message; ``http.disconnect`` only once
the reply is complete (an earlier one means the client left, and the router
cancels the handler: ``gym_sessions.routing.disconnect``). Used by the
in-process tests of whole apps and by ``benchmarks/framework_cost.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Reply", "asgi_request"]

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


@dataclass
class Reply:
    """A reply: status, headers (raw names as sent) and the whole body."""

    status: int
    headers: dict[bytes, bytes]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def asgi_request(
    app: ASGIApp,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] | None = None,
    client: tuple[str, int] = ("127.0.0.1", 50000),
) -> Reply:
    """Send one request to ``app`` from ``client``; returns its reply."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"worker"),
            (b"content-length", str(len(body)).encode()),
            *(headers or []),
        ],
        "client": client,
        "server": ("127.0.0.1", 8000),
    }
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    replied = asyncio.Event()
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop()
        await replied.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            replied.set()

    await app(scope, receive, send)
    start, *rest = messages
    assert start["type"] == "http.response.start", start
    assert rest and not rest[-1].get("more_body", False), "the reply did not end"
    return Reply(
        start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in rest)
    )
