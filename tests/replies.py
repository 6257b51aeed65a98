"""One HTTP reply type for the black-box tests: status, body text, cookies, error code."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp

__all__ = ["COOKIE", "TOKEN", "Reply", "post"]

COOKIE = "gym_session"
TOKEN = "X-Gym-Session-Token"


@dataclass
class Reply:
    status: int
    text: str
    set_cookies: list[str]

    @property
    def json(self) -> Any:
        """The body parsed as JSON; ``None`` if it is not JSON."""
        try:
            return json.loads(self.text)
        except ValueError:
            return None

    @property
    def cookie(self) -> str | None:
        """The ``gym_session`` value a ``Set-Cookie`` of this reply sets, if any."""
        for header in self.set_cookies:
            name, _, value = header.split(";", 1)[0].partition("=")
            if name.strip() == COOKIE and value.strip():
                return value.strip()
        return None

    @property
    def token(self) -> str | None:
        """The MCP session token a session start returns, if any."""
        body = self.json
        if isinstance(body, dict) and isinstance(body.get("mcp"), dict):
            return body["mcp"].get("headers", {}).get(TOKEN)
        return None

    @property
    def code(self) -> Any:
        """The framework error code: ``error.code``, or a JSON-RPC error's ``data.code``."""
        body = self.json
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict):
            return None
        if isinstance(error.get("data"), dict):
            return error["data"].get("code")
        return error.get("code")

    def describe(self) -> str:
        return f"HTTP {self.status} {self.text[:300]!r} set-cookie={self.set_cookies}"


async def post(
    web: aiohttp.ClientSession,
    url: str,
    body: Any = None,
    *,
    cookie: str | None = None,
    token: str | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    """POST ``body`` as JSON, with the session's cookie and MCP token if given."""
    send = dict(headers or {})
    if cookie is not None:
        send["Cookie"] = f"{COOKIE}={cookie}"
    if token is not None:
        send[TOKEN] = token
    async with web.post(url, json=body, headers=send) as reply:
        return Reply(reply.status, await reply.text(), reply.headers.getall("Set-Cookie", []))
