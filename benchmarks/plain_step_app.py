"""A bare ASGI app doing a counter step's JSON work: no gym-sessions, no Starlette.

`pooled_connection.py --floor` serves it from plain uvicorn processes (one
worker each, a port each) to measure what this machine charges a sequential
client for taking turns between processes, with nothing of ours in the way.
"""

from __future__ import annotations

import json
import os
from typing import Any

_HEALTH = json.dumps({"status": "ok", "worker": f"plain-{os.getpid()}"}).encode()


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``GET /health`` names the process; any other request is a counter step."""
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    if scope["path"] == "/health":
        reply = _HEALTH
    else:
        action = json.loads(body)["action"] if body else 0
        reply = json.dumps(
            {"observation": action, "reward": 0.0, "terminated": False, "truncated": False}
        ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(reply))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": reply})
