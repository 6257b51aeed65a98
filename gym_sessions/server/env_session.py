"""An agent's handle on one session of an environment (resources) server.

It sends through the clients' HTTP layer (`gym_sessions.client.async_http`,
over the agent's shared aiohttp pool), so it carries the session cookie, resends
what is safe to resend after a lost reply and recovers a lost ``/step`` reply
exactly as `AsyncRemoteEnv` does (`gym_sessions.client.exchange`,
`gym_sessions.client.step_recovery`). It names the session with an id it picks
(so a resent start cannot create a second session) and proves it owns it with a
random ``session_key`` (so its close reaches the session even when it never
received the cookie). Every failure becomes a `BadGatewayError` whose message
names the env server, the route and the cause.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import aiohttp

from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.exchange import Request
from gym_sessions.client.protocol import (
    SPACES_REQUEST,
    close_request,
    session_names,
    start_request,
    step_request,
    verify_request,
)
from gym_sessions.client.step_recovery import StepRecovery
from gym_sessions.errors import BadGatewayError, GymSessionsError, HTTPError

__all__ = ["EnvSession", "bad_gateway"]

_START_ROUTE = "/seed_session"


def bad_gateway(url: str, route: str, error: GymSessionsError) -> BadGatewayError:
    """The agent's error for an env server's ``error`` on ``route``: 502, naming all three."""
    if isinstance(error, HTTPError):
        return BadGatewayError(
            f"env server {url} answered {route} with {error.status} {error.code}: {error.message}"
        )
    return BadGatewayError(f"env server {url} failed on {route}: {error}")


class EnvSession:
    """One session on the env server at ``url``.

    Args:
        client: The agent's shared aiohttp session (its cookie jar is not used).
        url: The env server's base URL.

    Raises:
        BadGatewayError: ``url`` is not an ``http(s)://host:port`` URL.
    """

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.url = url.rstrip("/")
        try:
            self._http = AsyncHTTPClient(self.url, pool=client)
        except ValueError as exc:
            raise BadGatewayError(f"env server {url}: {exc}") from exc
        self.session_id = uuid.uuid4().hex
        self.session_key = secrets.token_urlsafe(32)
        self.started = False
        #: Steps of the open episode, as the env server counts them (``/observe``).
        self.episode_length = 0

    async def spaces(self) -> dict[str, Any]:
        """The env server's ``/spaces``."""
        return await self._send(SPACES_REQUEST)

    async def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start the session (``/seed_session``) with this handle's id."""
        first = not self.started
        self.started = True
        names = session_names(self.session_id, self.session_key)
        reply = await self._send(start_request(_START_ROUTE, names, body, first=first))
        self.episode_length = 0
        return reply

    async def step(self, action: Any) -> dict[str, Any]:
        """One ``/step`` (``action`` already in JSON)."""
        recovery = StepRecovery(
            step_request(action, self.episode_length), self.episode_length, self._step_ran
        )
        try:
            reply = await self._http.send_step(recovery)
        except GymSessionsError as error:
            raise bad_gateway(self.url, recovery.step.path, error) from error
        except ValueError as exc:  # a policy's action strict JSON cannot carry (NaN, say)
            raise BadGatewayError(
                f"env server {self.url} failed on {recovery.step.path}: {exc}"
            ) from exc
        self.episode_length += 1
        return reply.json()

    def _step_ran(self) -> None:
        self.episode_length += 1  # its reply was lost, but the server counts it

    async def verify(self, *, close_follows: bool = True) -> dict[str, Any]:
        """``/verify``; by default the session stays open for the close that follows."""
        return await self._send(verify_request(close_follows, {}))

    async def close(self) -> dict[str, Any]:
        """``/close_session`` by body id and key: reaches the session even without a cookie."""
        return await self._send(close_request(session_names(self.session_id, self.session_key)))

    async def _send(self, request: Request) -> Any:
        try:
            reply = await self._http.send(request)
        except GymSessionsError as error:
            raise bad_gateway(self.url, request.path, error) from error
        return reply.json()
