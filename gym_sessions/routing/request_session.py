"""What the router learned about a request's session, handed down in the ASGI scope."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Scope

if TYPE_CHECKING:
    from gym_sessions.routing.owned_claims import RoomReservation

from gym_sessions.credentials import SessionToken
from gym_sessions.routing.session_ids import IdSource

__all__ = [
    "REQUEST_SESSION_KEY",
    "RequestSession",
    "SessionData",
    "claims_on_reply",
    "request_session",
]

REQUEST_SESSION_KEY = "gym_sessions.request_session"
_NO_BODY = object()


class SessionData(dict):
    """``request.session``: a dict that records whether the handler read or wrote it.

    The router claims a new session only if its handler used the session, so
    every read or write of this dict counts.
    """

    accessed: bool = False
    modified: bool = False

    def _read(self) -> None:
        self.accessed = True

    def _write(self) -> None:
        self.accessed = self.modified = True

    def __getitem__(self, key: Any) -> Any:
        self._read()
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self._read()
        return super().__contains__(key)

    def __iter__(self) -> Any:
        self._read()
        return super().__iter__()

    def __len__(self) -> int:
        self._read()
        return super().__len__()

    def get(self, key: Any, default: Any = None) -> Any:
        self._read()
        return super().get(key, default)

    def keys(self) -> Any:
        self._read()
        return super().keys()

    def values(self) -> Any:
        self._read()
        return super().values()

    def items(self) -> Any:
        self._read()
        return super().items()

    def copy(self) -> dict:
        self._read()
        return dict(super().items())

    def __setitem__(self, key: Any, value: Any) -> None:
        self._write()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._write()
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._write()
        return super().pop(key, *default)

    def popitem(self) -> Any:
        self._write()
        return super().popitem()

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._write()
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._write()
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self._write()
        super().clear()


@dataclass
class RequestSession:
    """The session a request names, as the router found it.

    Attributes:
        session_id: The id (found or minted).
        source: Which source named it.
        claims_first: The request is claimed before its handler runs (a session
            start, or a close naming an id).
        claims_on_use: A handler that uses the session claims it (see
            `SessionIdSources.claims_on_use`).
        cookie: The request's verified cookie data, or ``None``.
        token: The request's verified MCP session token, or ``None`` (dropped by
            the holder when it belongs to another incarnation).
        session_key: The ``session_key`` of a typed body, or ``None``.
        incarnation: Nonce of the session's incarnation, set on the worker that
            serves the request; the cookie and tokens of the reply carry it.
        provisional: The router claimed the id for this request only because
            the request named it (a cookie of an unclaimed id): the claim ends
            with the request unless the handler used the session.
        starts: A session start (room is needed for it under ``--max-sessions``).
        room: The room a start reserved on this worker, given back when the
            request ends (unless its session went live and kept it).
        json_body: The parsed JSON body when the router had to parse it.
        body: The body as the router read it, on the worker serving the request
            (`read_json` parses it there, rather than reading it again through
            the ASGI ``receive``).
        data: ``request.session``, set by `SessionCookie.attach`.
    """

    session_id: str
    source: IdSource
    claims_first: bool
    claims_on_use: bool
    cookie: dict[str, Any] | None = None
    token: SessionToken | None = field(default=None, repr=False)
    session_key: str | None = field(default=None, repr=False)
    incarnation: str | None = field(default=None, repr=False)
    provisional: bool = False
    starts: bool = False
    room: RoomReservation | None = field(default=None, repr=False)
    json_body: Any = _NO_BODY
    body: bytes | None = field(default=None, repr=False)
    data: SessionData | None = field(default=None, repr=False)

    @property
    def has_json_body(self) -> bool:
        """Whether the router already parsed the body."""
        return self.json_body is not _NO_BODY

    @property
    def used(self) -> bool:
        """Whether the handler read or wrote ``request.session``."""
        return self.data is not None and self.data.accessed


def request_session(scope: Scope) -> RequestSession:
    """The `RequestSession` the router put in ``scope``."""
    return scope[REQUEST_SESSION_KEY]


def claims_on_reply(routed: RequestSession, status: int) -> bool:
    """Whether a reply with ``status`` makes the session its client's by use.

    On servers whose sessions start on use, a handler that used the session
    claims it (if the router had not) and the reply names it in a cookie: for a
    cookie's id always (the reply may name a new incarnation of it), for a
    minted or body id only when the reply is no error, and never for a token's
    id: a token holder must not gain the cookie, which reaches every route.
    """
    if not (routed.claims_on_use and routed.used) or routed.source is IdSource.TOKEN:
        return False
    return routed.source is IdSource.COOKIE or status < 400
