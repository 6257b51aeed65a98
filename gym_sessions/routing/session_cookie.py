"""``request.session`` from the signed session cookie, and the cookie on the reply.

The router has already verified the cookie and chosen the session id;
`SessionCookie` puts that id into ``request.session`` and decides whether the reply
names the session in a ``Set-Cookie``: a session start does while this worker
holds its claim (an agent seed that created nothing gives its claim up, so its
reply names nothing); on servers whose sessions start on use, another request
does when its handler used the session (`claims_on_reply`); and a request whose
handler changed the session data does. A cookie that already names the
session's current incarnation is not sent again.
"""

from __future__ import annotations

from starlette.types import Scope

from gym_sessions.credentials import INCARNATION_KEY, SessionCredentials
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.request_session import RequestSession, SessionData, claims_on_reply
from gym_sessions.routing.session_ids import IdSource

__all__ = ["SessionCookie"]

_SET_COOKIE = b"set-cookie"


class SessionCookie:
    """Provides ``request.session`` and the session cookie of a reply.

    The router uses it around the handler of every request it serves here
    (no middleware layer of its own: one coroutine and one ``send`` wrapper
    less per request): `attach` before the handler, `header` when the reply starts.

    Args:
        credentials: Signs the cookie.
        cookie_key: The key of the session id in the cookie data.
        claims: This worker's claims: a start whose claim is being given up (an
            agent seed that created nothing) names no session.
    """

    def __init__(
        self, credentials: SessionCredentials, cookie_key: str, claims: OwnedClaims
    ) -> None:
        self.credentials = credentials
        self.cookie_key = cookie_key
        self.claims = claims

    def attach(self, scope: Scope, routed: RequestSession) -> None:
        """Give the request its ``request.session``: the cookie's data, naming its session."""
        data = SessionData(routed.cookie or {})
        # Set without marking the data used: naming the id (and the incarnation
        # the router admitted the request to) is the router's doing.
        dict.__setitem__(data, self.cookie_key, routed.session_id)
        dict.__setitem__(data, INCARNATION_KEY, routed.incarnation)
        scope["session"] = routed.data = data

    def header(self, routed: RequestSession, status: int) -> tuple[bytes, bytes] | None:
        """The ``Set-Cookie`` header of the reply starting with ``status``, if it gets one.

        Decided as the handler's reply starts, before the router claims a
        session on that reply.
        """
        data = routed.data
        assert data is not None  # attached before the handler ran
        # A refused or failed start names nothing: its owner has the key.
        announce = (
            routed.claims_first and status < 400 and self.claims.holds(routed.session_id)
        ) or claims_on_reply(routed, status)
        if not data.modified and not announce:
            return None
        already_named = (
            routed.source is IdSource.COOKIE
            and routed.cookie is not None
            and routed.cookie.get(INCARNATION_KEY) == routed.incarnation
        )
        if not data.modified and already_named:
            return None  # a cookie naming the current incarnation is not sent again
        return _SET_COOKIE, self.credentials.set_cookie_header(dict.copy(data))
