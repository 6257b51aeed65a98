"""An agent's handle on one session of an environment (resources) server.

It sends through the clients' HTTP layer (`gym_sessions.client.async_http`,
over the agent's `ConnectionPool` for that env server), so it carries the session cookie, resends
what is safe to resend after a lost reply and recovers a lost ``/step`` reply
exactly as `AsyncRemoteEnv` does (`gym_sessions.client.exchange`,
`gym_sessions.client.step_recovery`). It names the session with an id it picks
(so a resent start cannot create a second session) and proves it owns it with a
random ``session_key`` (so its close reaches the session even when it never
received the cookie). Every failure becomes a `BadGatewayError` whose message
names the env server, the route and the cause: the status and the framework's
error code of an error reply, never its message or any other byte of it (an
env server's reply may be a local service's page; issue 33). A reply that is
not the JSON object the route needs is `BadUpstreamError` naming the field,
and so is a reply the agent's pool refused to read (too large, a redirect).
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.connection_pool import ConnectionPool
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
from gym_sessions.errors import (
    BadGatewayError,
    BadUpstreamError,
    GymSessionsError,
    HTTPError,
    RefusedReplyError,
)

__all__ = ["EnvSession", "bad_gateway", "reply_fields"]


def reply_fields(what: str, reply: Any, *names: str) -> dict[str, Any]:
    """``reply`` if it is a JSON object with every field in ``names``.

    Raises:
        BadUpstreamError: it is not an object, or lacks a field (named).
    """
    if not isinstance(reply, dict):
        raise BadUpstreamError(f"{what}: the reply is not a JSON object")
    for name in names:
        if name not in reply:
            raise BadUpstreamError(f"{what}: the reply has no field {name!r}")
    return reply


_START_ROUTE = "/seed_session"


def bad_gateway(url: str, route: str, error: GymSessionsError) -> BadGatewayError:
    """The agent's error for an env server's ``error`` on ``route``: 502, naming all three."""
    if isinstance(error, HTTPError):
        # Status and code only: `error_from_body` maps any code it does not know
        # to its status's, so both are the framework's words, not the upstream's.
        return BadGatewayError(
            f"env server {url} answered {route} with {error.status} {error.code}"
        )
    return BadGatewayError(f"env server {url} failed on {route}: {error}")


class EnvSession:
    """One session on the env server at ``url``.

    Args:
        client: The agent's connections to the env server (`AgentServer.env_pool`).
        url: The env server's base URL.

    Raises:
        BadGatewayError: ``url`` is not an ``http(s)://host:port`` URL.
    """

    def __init__(self, client: ConnectionPool, url: str) -> None:
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
        reply = await self._send(SPACES_REQUEST)
        return reply_fields(self._what("/spaces"), reply, "action_space", "observation_space")

    async def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start the session (``/seed_session``) with this handle's id."""
        first = not self.started
        self.started = True
        names = session_names(self.session_id, self.session_key)
        reply = await self._send(start_request(_START_ROUTE, names, body, first=first))
        self.episode_length = 0
        return reply_fields(self._what(_START_ROUTE), reply, "observation", "info")

    async def step(self, action: Any) -> dict[str, Any]:
        """One ``/step`` (``action`` already in JSON)."""
        recovery = StepRecovery(
            step_request(action, self.episode_length), self.episode_length, self._step_ran
        )
        try:
            reply = await self._http.send_step(recovery)
        except RefusedReplyError as refused:
            raise BadUpstreamError(f"{self._what(recovery.step.path)}: {refused}") from None
        except GymSessionsError as error:
            raise bad_gateway(self.url, recovery.step.path, error) from error
        except ValueError as exc:  # a policy's action strict JSON cannot carry (NaN, say)
            raise BadGatewayError(
                f"env server {self.url} failed on {recovery.step.path}: {exc}"
            ) from exc
        self.episode_length += 1
        fields = ("observation", "reward", "terminated", "truncated", "info")
        return reply_fields(
            self._what(recovery.step.path), _json(reply, self._what("/step")), *fields
        )

    def _step_ran(self) -> None:
        self.episode_length += 1  # its reply was lost, but the server counts it

    async def verify(self, *, close_follows: bool = True) -> dict[str, Any]:
        """``/verify``; by default the session stays open for the close that follows."""
        reply = await self._send(verify_request(close_follows, {}))
        return reply_fields(self._what("/verify"), reply, "reward")

    async def close(self) -> dict[str, Any]:
        """``/close_session`` by body id and key: reaches the session even without a cookie."""
        return await self._send(close_request(session_names(self.session_id, self.session_key)))

    async def _send(self, request: Request) -> Any:
        try:
            reply = await self._http.send(request)
        except RefusedReplyError as refused:
            raise BadUpstreamError(f"{self._what(request.path)}: {refused}") from None
        except GymSessionsError as error:
            raise bad_gateway(self.url, request.path, error) from error
        return _json(reply, self._what(request.path))

    def _what(self, route: str) -> str:
        return f"env server {self.url} on {route}"


def _json(reply: Any, what: str) -> Any:
    try:
        return reply.json()
    except ValueError:
        raise BadUpstreamError(f"{what}: the reply is not JSON") from None
