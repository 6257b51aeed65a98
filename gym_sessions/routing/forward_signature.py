"""Signatures on requests forwarded between hosts (Redis claims only).

A worker's private TCP listener is reachable from the network, so it must not
become a way around routing ("always served here") or around authentication.
Every forwarded request carries

    x-gym-forward-signature: <unix time>.<sha256 of the body>.<hmac>

where the HMAC-SHA256 (with a key derived from the server secret) covers the
time, the worker it is meant for, the method, the target, every forwarded
header, the hop's marks (`PLACED_MARK`, `HELD_MARK`: so nobody but a peer can
set one) and the body's digest. The private listener checks everything but the
body before reading it (so an unsigned request costs it no body), then the
body against the signed digest, and refuses any mismatch with 403 ``forbidden``.
A signature is good for ``max_age_seconds`` either side of the listener's
clock and only at the worker it names; a captured request could be replayed
there within that time, so private traffic belongs on a trusted network.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from starlette.types import Scope

from gym_sessions.errors import ForbiddenError
from gym_sessions.routing.hop_headers import (
    SIGNATURE_HEADER,
    forwarded_headers,
    hop_marks,
    received_marks,
    request_target,
)

__all__ = ["SIGNATURE_HEADER", "ForwardSigner"]

_MAX_TIMESTAMP_DIGITS = 12


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

    def _mac(
        self,
        timestamp: bytes,
        worker_id: str,
        scope: Scope,
        body_digest: bytes,
        marks: list[tuple[bytes, bytes]] | tuple[()] = (),
    ) -> bytes:
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        fields = [timestamp, worker_id.encode(), scope["method"].encode(), request_target(scope)]
        for name, value in [*forwarded_headers(scope), *marks]:
            fields += [name, value]
        fields.append(body_digest)
        for field in fields:
            # Length-prefixed, so no two different requests give the same input.
            mac.update(len(field).to_bytes(8, "big"))
            mac.update(field)
        return mac.hexdigest().encode()

    def header(self, scope: Scope, body: bytes, worker_id: str) -> tuple[bytes, bytes]:
        """The signature header for forwarding ``scope`` with ``body`` to ``worker_id``."""
        timestamp = str(int(time.time())).encode()
        digest = hashlib.sha256(body).hexdigest().encode()
        mac = self._mac(timestamp, worker_id, scope, digest, hop_marks(scope))
        return SIGNATURE_HEADER, b".".join((timestamp, digest, mac))

    def verify_head(self, scope: Scope, worker_id: str) -> bytes:
        """Check everything but the body; returns the body digest it was signed with.

        Raises:
            ForbiddenError: the signature is missing, malformed, too old, not
                for ``worker_id`` or does not match the request.
        """
        values = [value for name, value in scope["headers"] if name == SIGNATURE_HEADER]
        if len(values) != 1:
            raise ForbiddenError("private listener: the request is not signed by a peer worker")
        parts = values[0].split(b".")
        if len(parts) != 3:
            raise ForbiddenError("private listener: the request's signature is malformed")
        timestamp, digest, mac = parts
        if not (0 < len(timestamp) <= _MAX_TIMESTAMP_DIGITS and timestamp.isdigit()):
            raise ForbiddenError("private listener: the request's signature is malformed")
        if abs(time.time() - int(timestamp)) > self.max_age_seconds:
            raise ForbiddenError("private listener: the request's signature has expired")
        expected = self._mac(timestamp, worker_id, scope, digest, received_marks(scope))
        if not hmac.compare_digest(expected, mac):
            raise ForbiddenError("private listener: the request's signature is invalid")
        return digest

    @staticmethod
    def verify_body(digest: bytes, body: bytes) -> None:
        """Check the body against the digest `verify_head` returned.

        Raises:
            ForbiddenError: the body is not the one that was signed.
        """
        if not hmac.compare_digest(hashlib.sha256(body).hexdigest().encode(), digest):
            raise ForbiddenError("private listener: the request's body is not the signed one")
