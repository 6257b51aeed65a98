"""A session id's incarnation on its holder: the nonce its credentials carry (§3.8).

Kept apart from the ownership rule (`gym_sessions.routing.session_access`) that
checks it: the claims that keep an incarnation and the snapshots that carry
one need the record, not the rule.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

__all__ = ["Incarnation", "new_incarnation_nonce"]


def new_incarnation_nonce() -> str:
    """A fresh, unguessable incarnation nonce."""
    return secrets.token_urlsafe(16)


@dataclass
class Incarnation:
    """One life of a session id on its holder: from its claim to the claim's end.

    Attributes:
        nonce: Carried by this incarnation's cookie and tokens.
        key_digest: Digest of the bound ``session_key``, or ``None``.
        bound: A request has been admitted to it (the one that created it first).
    """

    nonce: str = field(default_factory=new_incarnation_nonce)
    key_digest: bytes | None = field(default=None, repr=False)
    bound: bool = False
