"""Signed session cookies and MCP session tokens.

The cookie uses Starlette's ``SessionMiddleware`` encoding (base64 JSON signed by
an itsdangerous ``TimestampSigner``), so the router can read the session id
from it before any middleware runs. Tokens are ``{"sid": ...}`` signed with the
same secret under their own salt, so a cookie can never pass as a token. Both
expire after `COOKIE_MAX_AGE_SECONDS` (14 days), like Starlette's cookie.
"""

from __future__ import annotations

import binascii
import json
from base64 import b64decode, b64encode
from typing import Any

import itsdangerous

__all__ = ["COOKIE_MAX_AGE_SECONDS", "SessionCredentials"]

COOKIE_MAX_AGE_SECONDS = 14 * 24 * 60 * 60
_TOKEN_SALT = "gym-sessions.mcp-session-token"


class SessionCredentials:
    """Signs and verifies the session cookie and the MCP session token."""

    def __init__(self, secret: str, cookie_name: str) -> None:
        self.cookie_name = cookie_name
        self._cookie_signer = itsdangerous.TimestampSigner(secret)
        self._token_serializer = itsdangerous.URLSafeTimedSerializer(secret, salt=_TOKEN_SALT)

    def encode_cookie(self, data: dict[str, Any]) -> str:
        """The cookie value carrying ``data``."""
        payload = b64encode(json.dumps(data, separators=(",", ":")).encode())
        return self._cookie_signer.sign(payload).decode()

    def decode_cookie(self, value: str) -> dict[str, Any] | None:
        """The data of a cookie value, or ``None`` if it is tampered, expired or malformed."""
        try:
            payload = self._cookie_signer.unsign(value, max_age=COOKIE_MAX_AGE_SECONDS)
            data = json.loads(b64decode(payload, validate=True))
        except (itsdangerous.BadSignature, binascii.Error, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def set_cookie_header(self, data: dict[str, Any]) -> bytes:
        """A ``Set-Cookie`` header value storing ``data``."""
        return (
            f"{self.cookie_name}={self.encode_cookie(data)}; path=/; "
            f"Max-Age={COOKIE_MAX_AGE_SECONDS}; httponly; samesite=lax"
        ).encode()

    def mint_token(self, session_id: str) -> str:
        """An MCP session token naming ``session_id``."""
        return self._token_serializer.dumps({"sid": session_id})

    def read_token(self, token: str) -> str | None:
        """The session id of a token, or ``None`` if it is not one of ours or has expired."""
        try:
            data = self._token_serializer.loads(token, max_age=COOKIE_MAX_AGE_SECONDS)
        except itsdangerous.BadData:
            return None
        sid = data.get("sid") if isinstance(data, dict) else None
        return sid if isinstance(sid, str) else None
