"""Who may reach a session: the ownership rule (docs/operating/credentials.md has it as a table).

A session belongs to whoever started it. The worker that claims a session
keeps, with the claim, the session's `Incarnation`: a random nonce minted when
the claim began and, once a start or close bound one, a digest of the client's
``session_key``. The session cookie and the MCP token carry the nonce, so when
the id's claim has ended and the id names a new session, the credentials of the
earlier one reach nothing.

`SessionAccess.admit` applies the rule on the holder, after the router found
the session and before any handler runs, so a refused request changes nothing,
sets no cookie and mints no token. A request reaches a held session when it
brings one of:

- the session cookie of this incarnation (every route);
- the MCP token of this incarnation (MCP tool calls only: the id sources table
  never lets a token name a session anywhere else);
- on a typed start or close, the ``session_key`` the session was bound to;
- on a typed start or close, nothing at all, if the server trusts session ids.

The first request admitted to a new incarnation (the start or close that
created the claim) needs no proof; it binds its ``session_key``, if any.
"""

from __future__ import annotations

import hmac

from gym_sessions.credentials import INCARNATION_KEY, SessionCredentials
from gym_sessions.errors import InvalidTokenError, SessionConflictError
from gym_sessions.routing.incarnations import Incarnation, new_incarnation_nonce
from gym_sessions.routing.request_session import RequestSession
from gym_sessions.routing.session_ids import SESSION_KEY_FIELD, IdSource

__all__ = ["SessionAccess"]


class SessionAccess:
    """The ownership rule of one worker.

    Args:
        credentials: Digests session keys.
        trust_session_ids: A typed start or close naming a session by id alone
            reaches it (``--trust-session-ids``; every client trusted).
    """

    def __init__(self, credentials: SessionCredentials, trust_session_ids: bool = False) -> None:
        self.credentials = credentials
        self.trust_session_ids = trust_session_ids

    def admit(self, routed: RequestSession, incarnation: Incarnation | None) -> None:
        """Let ``routed`` reach its session, or raise; sets ``routed.incarnation``.

        Args:
            routed: The request's session, as the router found it.
            incarnation: The session's incarnation if this worker holds its
                claim, else ``None`` (a freshly minted id, or nobody holds it).

        Raises:
            SessionConflictError: the session is held and the request brings
                no proof that it belongs to it (409 ``session_conflict``).
            InvalidTokenError: the request's only credential is a token of an
                incarnation that has ended (401 ``invalid_token``).
        """
        if incarnation is None:
            if routed.source is IdSource.TOKEN:
                raise InvalidTokenError("the session this token was minted for has ended")
            routed.token = None  # names a session nobody holds: a token of an ended one
            routed.incarnation = new_incarnation_nonce()
            return
        if incarnation.bound and not self._proves_ownership(routed, incarnation):
            if routed.source is IdSource.TOKEN:
                raise InvalidTokenError("the session this token was minted for has ended")
            raise SessionConflictError(
                f"session {routed.session_id!r} is held by another client: a request reaches "
                f"it only with its session cookie or, on a start or close, its {SESSION_KEY_FIELD}"
            )
        incarnation.bound = True
        if routed.session_key is not None and incarnation.key_digest is None:
            # The first key brought by an admitted start or close binds the session.
            incarnation.key_digest = self._digest(routed)
        if routed.token is not None and not _same(routed.token.incarnation, incarnation.nonce):
            routed.token = None  # beside a good cookie, a stale token is no token
        routed.incarnation = incarnation.nonce

    def _proves_ownership(self, routed: RequestSession, incarnation: Incarnation) -> bool:
        if routed.source is IdSource.COOKIE and routed.cookie is not None:
            nonce = routed.cookie.get(INCARNATION_KEY)
            if isinstance(nonce, str) and _same(nonce, incarnation.nonce):
                return True
        if routed.source is IdSource.TOKEN and routed.token is not None:
            return _same(routed.token.incarnation, incarnation.nonce)
        if (
            routed.session_key is not None
            and incarnation.key_digest is not None
            and hmac.compare_digest(self._digest(routed), incarnation.key_digest)
        ):
            return True
        return routed.source is IdSource.BODY and self.trust_session_ids

    def _digest(self, routed: RequestSession) -> bytes:
        assert routed.session_key is not None
        return self.credentials.session_key_digest(routed.session_id, routed.session_key)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())
