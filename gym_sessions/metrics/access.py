"""Who may read ``GET /metrics``.

- No token (the default): loopback clients only (127.0.0.0/8, ::1, and
  IPv4-mapped loopback); anyone else gets 403 ``forbidden``. Behind a reverse
  proxy on the same host every client looks local: give the server a token.
- A token (``--metrics-token-file``): ``Authorization: Bearer <token>`` from
  every client, loopback ones included (so a proxy in front cannot open the
  page to everyone); a missing or wrong one gets 401 ``invalid_token``.
  Exactly one ``Authorization`` header is read: a request with several gets
  400 ``invalid_request`` (a proxy and a client could otherwise each add one,
  and "any of them matches" would let a guess ride beside a forwarded token).

``--metrics off`` removes the page altogether (404, as any unknown route).
"""

from __future__ import annotations

import hmac
import ipaddress

from starlette.types import Scope

from gym_sessions.errors import ForbiddenError, InvalidRequestError, InvalidTokenError

__all__ = ["MetricsAccess", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as ASGI gives it) is a loopback address."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class MetricsAccess:
    """The access rule of ``GET /metrics``.

    Args:
        token: The bearer token every client must send; empty: loopback only.
    """

    def __init__(self, token: str = "") -> None:
        self._token = token.encode()

    @property
    def needs_token(self) -> bool:
        """Whether every client must send the token."""
        return bool(self._token)

    def check(self, scope: Scope) -> None:
        """Return if the request may read the page.

        Raises:
            InvalidRequestError: a token is required and the request has several
                ``Authorization`` headers.
            InvalidTokenError: a token is required and missing or wrong.
            ForbiddenError: no token is configured and the client is not loopback.
        """
        if self._token:
            if not self._bearer_matches(scope["headers"]):
                raise InvalidTokenError(
                    "GET /metrics needs the header Authorization: Bearer <token>, with the "
                    "token of the server's --metrics-token-file"
                )
            return
        client = scope.get("client")
        if client is None or not is_loopback(client[0]):
            raise ForbiddenError(
                "GET /metrics is answered to loopback clients only; to read it from elsewhere, "
                "start the server with --metrics-token-file PATH and send "
                "Authorization: Bearer <token>"
            )

    def _bearer_matches(self, headers: list[tuple[bytes, bytes]]) -> bool:
        values = [value for name, value in headers if name == b"authorization"]
        if len(values) > 1:
            raise InvalidRequestError(
                f"GET /metrics takes one Authorization header, not {len(values)}"
            )
        if not values:
            return False
        scheme, _, credentials = values[0].strip().partition(b" ")
        # The scheme is case-insensitive (RFC 9110); the token is compared in
        # constant time (hmac.compare_digest), whatever the scheme.
        matches = hmac.compare_digest(credentials.strip(), self._token)
        return scheme.lower() == b"bearer" and matches
