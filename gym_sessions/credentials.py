"""Signed session cookies, opaque MCP session tokens and session-key digests.

The cookie uses Starlette's ``SessionMiddleware`` encoding (base64 JSON signed by
an itsdangerous ``TimestampSigner``), so the router can read the session id
from it before any middleware runs. Cookies are signed by itsdangerous; every
request's cookie is verified here against the signer's own derived key, kept
as a ready HMAC state (itsdangerous derives the key and keys a new HMAC on
every call, about half the cost of reading a cookie), accepting exactly the
values the signer makes. Its holder owns the session, so it may
read what it carries (the id and the incarnation nonce).

The MCP session token is handed to tool clients that may be sandboxed (an LLM
harness), so it must tell them nothing: it is a Fernet token (AES-128-CBC and
HMAC-SHA256, from ``cryptography``) encrypting ``{sid, inc, tools}`` under a key
derived from the secret. A token holder learns neither its session id nor which
tools it may call, and cannot widen either. Cookies and tokens use different
keys and formats, so one can never pass as the other. Both expire after
`COOKIE_MAX_AGE_SECONDS` (14 days), like Starlette's cookie.

Clock skew: with several hosts, a credential minted on one host is read on
another, whose clock may be behind. Both kinds are accepted from
`CLOCK_SKEW_SECONDS` (60 s) in the reader's future up to
`COOKIE_MAX_AGE_SECONDS` in its past, in whole seconds of ``int(time.time())``
at both ends. For tokens that is Fernet's own rule (``cryptography.fernet``
refuses a timestamp more than its ``_MAX_CLOCK_SKEW = 60`` seconds ahead); for
cookies ``decode_cookie`` applies the same rule, since itsdangerous refuses any
cookie signed even one second in the future. The skew never lengthens the
maximum age: expiry is judged on the reader's clock, so a credential minted
on a host running ``s`` seconds ahead lives ``s`` seconds longer elsewhere, one
from a host behind ``s`` seconds shorter. (Forwarded requests between hosts
have a tighter window of their own, 30 s either side:
`gym_sessions.routing.forward_signature`.)

A ``session_key`` (the client's proof for typed starts and closes without a
cookie) is never stored: only an HMAC of it, bound to the session id.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from base64 import b64decode, b64encode
from dataclasses import dataclass
from typing import Any

import itsdangerous
from cryptography.fernet import Fernet, InvalidToken

__all__ = [
    "CLOCK_SKEW_SECONDS",
    "COOKIE_MAX_AGE_SECONDS",
    "INCARNATION_KEY",
    "SessionCredentials",
    "SessionToken",
]

COOKIE_MAX_AGE_SECONDS = 14 * 24 * 60 * 60
#: How far in the reader's future a cookie's or token's timestamp may be (another
#: host's clock running ahead). Fernet's built-in tolerance, applied to cookies too.
CLOCK_SKEW_SECONDS = 60
#: Verified cookie values a `SessionCredentials` remembers (then it starts afresh).
_VERIFIED_COOKIES = 4096
#: Key of the session's incarnation nonce in the cookie data (beside its id).
INCARNATION_KEY = "incarnation"


def _derived_key(secret: str, purpose: bytes) -> bytes:
    # One secret, independent keys per use: a key of one kind says nothing of another.
    return hmac.new(secret.encode(), b"gym-sessions/" + purpose, hashlib.sha256).digest()


@dataclass(frozen=True)
class SessionToken:
    """What an MCP session token carries once decrypted.

    Attributes:
        session_id: The session it was minted for.
        incarnation: The nonce of that session's incarnation: the token reaches
            nothing once the id names a later session.
        tools: The tools its holder may list and call; ``None`` means all.
    """

    session_id: str
    incarnation: str
    tools: frozenset[str] | None = None


class SessionCredentials:
    """Signs and verifies session cookies, mints and reads MCP tokens, digests session keys."""

    def __init__(self, secret: str, cookie_name: str) -> None:
        self.cookie_name = cookie_name
        self._cookie_signer = itsdangerous.TimestampSigner(secret)
        # The signer's key and digest, keyed once: each verification copies this state.
        self._cookie_mac = hmac.new(
            self._cookie_signer.derive_key(), digestmod=self._cookie_signer.digest_method
        )
        self._cookie_sep = itsdangerous.want_bytes(self._cookie_signer.sep)
        self._token_cipher = Fernet(base64.urlsafe_b64encode(_derived_key(secret, b"mcp-token")))
        self._session_key_mac = _derived_key(secret, b"session-key")
        # Cookie values whose signature verified, with their data and signing time:
        # a session's every request brings the same value (a step batch, one per
        # entry), and checking the signature is most of reading it.
        self._verified_cookies: dict[str, tuple[dict[str, Any], int]] = {}

    def encode_cookie(self, data: dict[str, Any]) -> str:
        """The cookie value carrying ``data``."""
        payload = b64encode(json.dumps(data, separators=(",", ":")).encode())
        return self._cookie_signer.sign(payload).decode()

    def decode_cookie(self, value: str) -> dict[str, Any] | None:
        """The data of a cookie value, or ``None`` if it is tampered, expired or malformed.

        The value is ``payload.timestamp.signature`` as itsdangerous signs it;
        only the signer's canonical encoding of a valid signature is accepted.
        """
        verified = self._verified_cookies.get(value)
        if verified is not None:
            # The very string verified before: only its age can have changed.
            data, signed_at = verified
            age = int(time.time()) - signed_at
            return dict(data) if -CLOCK_SKEW_SECONDS <= age <= COOKIE_MAX_AGE_SECONDS else None
        try:
            signed = value.encode("ascii")
        except UnicodeEncodeError:
            return None
        message, sep, signature = signed.rpartition(self._cookie_sep)
        payload, sep_before, stamp = message.rpartition(self._cookie_sep)
        if not sep or not sep_before:
            return None
        mac = self._cookie_mac.copy()
        mac.update(message)
        expected = base64.urlsafe_b64encode(mac.digest()).rstrip(b"=")
        if not hmac.compare_digest(expected, signature):
            return None
        try:
            signed_at = int.from_bytes(base64.urlsafe_b64decode(stamp + b"=" * (-len(stamp) % 4)))
            # No itsdangerous max_age: it refuses a cookie signed by a host whose
            # clock is even a second ahead ("Signature age -1 < 0").
            age = int(time.time()) - signed_at
            if not -CLOCK_SKEW_SECONDS <= age <= COOKIE_MAX_AGE_SECONDS:
                return None
            data = json.loads(b64decode(payload, validate=True))
        except (binascii.Error, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        if len(self._verified_cookies) >= _VERIFIED_COOKIES:
            self._verified_cookies.clear()  # bounded; hits are the same sessions' next requests
        self._verified_cookies[value] = (data, signed_at)
        return dict(data)

    def set_cookie_header(self, data: dict[str, Any]) -> bytes:
        """A ``Set-Cookie`` header value storing ``data``."""
        return (
            f"{self.cookie_name}={self.encode_cookie(data)}; path=/; "
            f"Max-Age={COOKIE_MAX_AGE_SECONDS}; httponly; samesite=lax"
        ).encode()

    def mint_token(
        self, session_id: str, incarnation: str, tools: frozenset[str] | None = None
    ) -> str:
        """An opaque MCP session token for one incarnation of ``session_id``."""
        payload: dict[str, Any] = {"sid": session_id, "inc": incarnation}
        if tools is not None:
            payload["tools"] = sorted(tools)
        return self._token_cipher.encrypt(json.dumps(payload).encode()).decode("ascii")

    def read_token(self, token: str) -> SessionToken | None:
        """What a token carries, or ``None`` if it is not one of ours or has expired."""
        # Fernet accepts timestamps up to 60 s ahead of this clock (CLOCK_SKEW_SECONDS).
        try:
            data = json.loads(
                self._token_cipher.decrypt(token.encode("ascii"), ttl=COOKIE_MAX_AGE_SECONDS)
            )
        except (InvalidToken, UnicodeError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        sid, incarnation, tools = data.get("sid"), data.get("inc"), data.get("tools")
        if not isinstance(sid, str) or not isinstance(incarnation, str):
            return None
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, str) for t in tools):
                return None
            tools = frozenset(tools)
        return SessionToken(sid, incarnation, tools)

    def session_key_digest(self, session_id: str, session_key: str) -> bytes:
        """The digest kept in place of ``session_key``; bound to the id, keyed by the secret."""
        message = session_id.encode() + b"\0" + session_key.encode()
        return hmac.new(self._session_key_mac, message, hashlib.sha256).digest()
