"""``request.session`` from the signed session cookie, and the cookie on the reply.

The router has already verified the cookie and chosen the session id; this
middleware puts that id into ``request.session`` and decides whether the reply
names the session in a ``Set-Cookie``: a session start does while this worker
holds its claim (an agent seed that created nothing gives its claim up, so its
reply names nothing); on servers whose sessions start on use, another request
does when its handler used the session (`claims_on_reply`); and a request whose
handler changed the session data does. A cookie that already names the
session's current incarnation is not sent again.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_sessions.credentials import INCARNATION_KEY, SessionCredentials
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.request_session import SessionData, claims_on_reply, request_session
from gym_sessions.routing.session_ids import IdSource

__all__ = ["SessionCookieMiddleware"]


class SessionCookieMiddleware:
    """Provides ``request.session`` and writes the session cookie.

    Args:
        app: The app.
        credentials: Signs the cookie.
        cookie_key: The key of the session id in the cookie data.
        claims: This worker's claims: a start whose claim is being given up (an
            agent seed that created nothing) names no session.
    """

    def __init__(
        self, app: ASGIApp, credentials: SessionCredentials, cookie_key: str, claims: OwnedClaims
    ) -> None:
        self.app = app
        self.credentials = credentials
        self.cookie_key = cookie_key
        self.claims = claims

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        routed = request_session(scope)
        data = SessionData(routed.cookie or {})
        # Set without marking the data used: naming the id (and the incarnation
        # the router admitted the request to) is the router's doing.
        dict.__setitem__(data, self.cookie_key, routed.session_id)
        dict.__setitem__(data, INCARNATION_KEY, routed.incarnation)
        scope["session"] = routed.data = data
        already_named = (
            routed.source is IdSource.COOKIE
            and routed.cookie is not None
            and routed.cookie.get(INCARNATION_KEY) == routed.incarnation
        )

        async def send_with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                # A refused or failed start names nothing: its owner has the key.
                announce = (
                    routed.claims_first and status < 400 and self.claims.holds(routed.session_id)
                ) or claims_on_reply(routed, status)
                if data.modified or (announce and not already_named):
                    headers = MutableHeaders(scope=message)
                    headers.append(
                        "set-cookie", self.credentials.set_cookie_header(dict.copy(data)).decode()
                    )
            await send(message)

        await self.app(scope, receive, send_with_cookie)
