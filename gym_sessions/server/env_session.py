"""An agent's handle on one session of an environment (resources) server.

It speaks the env server's HTTP routes over the agent's shared aiohttp pool,
names the session with an id it picks (so a retried start cannot create a
second session) and proves it owns it with a random ``session_key`` (so its
close reaches the session even when it never received the cookie), carries the
session cookie, and turns every failure into an
`HTTPError` whose message names the env server and the cause.
"""

from __future__ import annotations

import json
import secrets
import uuid
from typing import Any

import aiohttp

from gym_sessions.errors import BadGatewayError, HTTPError, error_from_body

__all__ = ["EnvSession"]

_COOKIE = "gym_session"


class EnvSession:
    """One session on the env server at ``url``.

    Args:
        client: The agent's shared aiohttp session (its cookie jar is not used).
        url: The env server's base URL.
    """

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.session_id = uuid.uuid4().hex
        self.session_key = secrets.token_urlsafe(32)
        self.started = False
        self._cookie: str | None = None

    async def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Any:
        """Send one request; returns the JSON reply.

        Raises:
            BadGatewayError: the env server cannot be reached, or replied with an
                error (the message names its status, code and message).
        """
        send_headers = dict(headers or {})
        if self._cookie:
            send_headers["Cookie"] = f"{_COOKIE}={self._cookie}"
        try:
            async with self.client.request(
                method, self.url + path, json=body, headers=send_headers
            ) as reply:
                data = await reply.read()
                morsel = reply.cookies.get(_COOKIE)
                if morsel is not None:
                    self._cookie = morsel.value
                status = reply.status
        except aiohttp.ClientError as exc:
            raise BadGatewayError(f"env server {self.url} failed on {path}: {exc}") from exc
        if status >= 400:
            error: HTTPError = error_from_body(status, data)
            raise BadGatewayError(
                f"env server {self.url} answered {path} with {status} {error.code}: {error.message}"
            )
        return json.loads(data) if data else None

    async def spaces(self) -> dict[str, Any]:
        """The env server's ``/spaces``."""
        return await self.request("GET", "/spaces")

    async def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start the session (``/seed_session``) with this handle's id."""
        self.started = True
        return await self.request("POST", "/seed_session", {**body, **self._names()})

    async def step(self, action: Any) -> dict[str, Any]:
        """One ``/step``."""
        return await self.request("POST", "/step", {"action": action})

    async def verify(self, *, close_follows: bool = True) -> dict[str, Any]:
        """``/verify``; by default the session stays open for the close that follows."""
        headers = {"x-gym-close-follows": "1"} if close_follows else {}
        return await self.request("POST", "/verify", {}, headers)

    async def close(self) -> dict[str, Any]:
        """``/close_session`` by body id and key: reaches the session even without a cookie."""
        return await self.request("POST", "/close_session", self._names())

    def _names(self) -> dict[str, str]:
        return {"resources_session_id": self.session_id, "session_key": self.session_key}
