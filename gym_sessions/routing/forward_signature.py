"""Signatures on requests forwarded between hosts (Redis claims only).

A worker's private TCP listener is reachable from the network, so it must not
become a way around routing ("always served here") or around authentication.
Every forwarded request carries ``x-gym-forward-signature: <unix time>.<hex>``,
an HMAC-SHA256 with a key derived from the server secret over the time, the
method, the target, the session credentials (``cookie`` and the session token
header) and the body. The private listener refuses (403 ``forbidden``) a
request whose signature is missing, wrong, or more than ``max_age_seconds``
off its own clock. A captured request could be replayed within that time, so
private traffic between hosts belongs on a trusted network (README).
"""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.types import Scope

from gym_sessions.errors import ForbiddenError
from gym_sessions.routing.forwarder import request_target

__all__ = ["SIGNATURE_HEADER", "ForwardSigner"]

SIGNATURE_HEADER = b"x-gym-forward-signature"
_SIGNED_HEADERS = (b"cookie", b"x-gym-session-token")


class ForwardSigner:
    """Signs forwarded requests and verifies them on the private listener.

    Args:
        secret: The server secret, the same on every host.
        max_age_seconds: How far a signature's time may be from the verifier's
            clock (hosts' clocks must agree to within this).
    """

    def __init__(self, secret: str, max_age_seconds: float = 30.0) -> None:
        # A key of its own: a forward signature can never pass for a cookie or token.
        self._key = hashlib.sha256(b"gym-sessions forward signature\0" + secret.encode()).digest()
        self.max_age_seconds = max_age_seconds

    def _digest(self, timestamp: bytes, scope: Scope, body: bytes) -> str:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        fields = [timestamp, scope["method"].encode(), request_target(scope)]
        for name in _SIGNED_HEADERS:
            fields.append(b"\0".join(value for key, value in scope["headers"] if key == name))
        fields.append(body)
        for field in fields:
            # Length-prefixed, so no two different requests give the same input.
            mac.update(len(field).to_bytes(8, "big"))
            mac.update(field)
        return mac.hexdigest()

    def header(self, scope: Scope, body: bytes) -> tuple[bytes, bytes]:
        """The signature header for forwarding ``scope`` with ``body``."""
        timestamp = str(int(time.time())).encode()
        return SIGNATURE_HEADER, timestamp + b"." + self._digest(timestamp, scope, body).encode()

    def verify(self, scope: Scope, body: bytes) -> None:
        """Check the signature of a request that arrived on a private listener.

        Raises:
            ForbiddenError: the signature is missing, wrong or too old.
        """
        values = [value for name, value in scope["headers"] if name == SIGNATURE_HEADER]
        if len(values) != 1:
            raise ForbiddenError("private listener: the request is not signed by a peer worker")
        timestamp, _, signature = values[0].partition(b".")
        if not timestamp.isdigit() or abs(time.time() - int(timestamp)) > self.max_age_seconds:
            raise ForbiddenError("private listener: the request's signature has expired")
        expected = self._digest(timestamp, scope, body)
        if not hmac.compare_digest(expected.encode(), signature):
            raise ForbiddenError("private listener: the request's signature is invalid")
