"""Where a request's session id comes from: the sources table (docs/operating/workers.md).

`find_session_id` is the one place that decides which id a request names, and
`find_session_key` the one place that reads the ``session_key`` a typed body
brings as proof; the router calls both for every request, with one worker too.
Which of these credentials reaches a session is decided by
`gym_sessions.routing.session_access`.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from gym_sessions.credentials import SessionCredentials, SessionToken
from gym_sessions.errors import (
    ForbiddenError,
    InvalidRequestError,
    InvalidSessionIdError,
    SessionConflictError,
)
from gym_sessions.wire import route_path  # re-exported: routes read it from here

__all__ = [
    "AGENT_SOURCES",
    "RESOURCES_SOURCES",
    "SESSION_KEY_FIELD",
    "SESSION_KEY_LENGTHS",
    "SESSION_TOKEN_HEADER",
    "FoundSessionId",
    "IdSource",
    "SessionIdSources",
    "find_session_id",
    "find_session_key",
    "is_valid_session_id",
    "read_credentials",
    "route_path",
]

SESSION_TOKEN_HEADER = "x-gym-session-token"
#: Body field of typed starts and closes carrying the client's proof of ownership.
SESSION_KEY_FIELD = "session_key"
SESSION_KEY_LENGTHS = (16, 256)
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


class IdSource(enum.Enum):
    """Which source named the session id."""

    COOKIE = "cookie"
    TOKEN = "token"
    BODY = "body"
    MINTED = "minted"


@dataclass(frozen=True)
class SessionIdSources:
    """Where one kind of server finds session ids.

    Attributes:
        cookie_key: Key of the id in the session cookie's data.
        body_key: Key of the id in a typed request body.
        typed_paths: Paths (rollout prefix removed) whose JSON body may carry the id
            (and a ``session_key``).
        token_paths: Paths where the MCP session token names the session (the
            token reaches MCP tool calls only).
        claims_on_use: Whether any request whose handler uses the session claims
            it (resources servers may create sessions on a tool call); agent
            sessions are created only by their seed.
    """

    cookie_key: str
    body_key: str
    typed_paths: frozenset[str]
    token_paths: frozenset[str]
    claims_on_use: bool


RESOURCES_SOURCES = SessionIdSources(
    cookie_key="session_id",
    body_key="resources_session_id",
    typed_paths=frozenset({"/seed_session", "/reset", "/close_session"}),
    token_paths=frozenset({"/mcp"}),
    claims_on_use=True,
)
AGENT_SOURCES = SessionIdSources(
    cookie_key="agent_session_id",
    body_key="agent_session_id",
    typed_paths=frozenset({"/v1/agent_sessions", "/v1/agent_sessions/close"}),
    token_paths=frozenset(),
    claims_on_use=False,
)


@dataclass(frozen=True)
class FoundSessionId:
    """A session id and the source that named it."""

    session_id: str
    source: IdSource


def is_valid_session_id(value: object) -> bool:
    """Whether ``value`` may name a session: 1-128 URL- and path-safe characters."""
    return isinstance(value, str) and _SESSION_ID.fullmatch(value) is not None


def read_credentials(
    headers: list[tuple[bytes, bytes]], credentials: SessionCredentials
) -> tuple[dict[str, Any] | None, SessionToken | None]:
    """The verified cookie data and session token of a request (``None`` when absent or bad)."""
    cookie_name = credentials.cookie_name
    cookie_value = token = None
    for name, value in headers:
        if name == b"cookie":
            for part in value.decode("latin-1").split(";"):
                key, _, val = part.strip().partition("=")
                if key == cookie_name:
                    cookie_value = val
        elif name == SESSION_TOKEN_HEADER.encode():
            token = value.decode("latin-1")
    cookie = credentials.decode_cookie(cookie_value) if cookie_value else None
    return cookie, credentials.read_token(token) if token else None


def find_session_id(
    sources: SessionIdSources,
    path: str,
    cookie: dict[str, Any] | None,
    token: SessionToken | None,
    body: Any,
) -> FoundSessionId | None:
    """The session id a request names, or ``None`` if it names none.

    Order: the cookie's id; else, on a token path, the token's id; a typed body
    id must agree with whichever of those is present (409 ``session_conflict``
    otherwise) and is the id when neither is. A body id that is present but
    malformed is 400; a token that is the only credential of a request
    elsewhere is 403 (it reaches MCP tool calls only).

    Args:
        sources: The server kind's sources.
        path: Request path with the rollout prefix removed.
        cookie: Verified cookie data, or ``None``.
        token: A verified session token, or ``None``.
        body: Parsed JSON body of a typed path, or ``None``.
    """
    found: FoundSessionId | None = None
    cookie_sid = cookie.get(sources.cookie_key) if cookie else None
    if isinstance(cookie_sid, str) and is_valid_session_id(cookie_sid):
        found = FoundSessionId(cookie_sid, IdSource.COOKIE)
    elif token is not None:
        if path not in sources.token_paths:
            raise ForbiddenError(
                "the session token reaches only MCP tool calls (POST /mcp); other routes "
                "need the session cookie"
            )
        if is_valid_session_id(token.session_id):
            found = FoundSessionId(token.session_id, IdSource.TOKEN)

    if path in sources.typed_paths and isinstance(body, dict):
        body_sid = body.get(sources.body_key)
        if body_sid is not None:
            if not is_valid_session_id(body_sid):
                raise InvalidSessionIdError(
                    f"{sources.body_key} must be 1-128 characters of letters, digits "
                    "and . _ : @ -, starting with a letter or digit"
                )
            if found is not None and found.session_id != body_sid:
                raise SessionConflictError(
                    f"the request's {found.source.value} names session {found.session_id!r} "
                    f"but its body names {body_sid!r}"
                )
            found = found or FoundSessionId(body_sid, IdSource.BODY)
    return found


def find_session_key(sources: SessionIdSources, path: str, body: Any) -> str | None:
    """The ``session_key`` a typed body brings, or ``None``.

    Raises:
        InvalidRequestError: the key is present but not a string of 16-256 characters.
    """
    if path not in sources.typed_paths or not isinstance(body, dict):
        return None
    key = body.get(SESSION_KEY_FIELD)
    if key is None:
        return None
    shortest, longest = SESSION_KEY_LENGTHS
    if not isinstance(key, str) or not shortest <= len(key) <= longest:
        raise InvalidRequestError(
            f"{SESSION_KEY_FIELD} must be a string of {shortest}-{longest} characters"
        )
    return key
