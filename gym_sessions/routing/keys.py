"""The names claims and snapshots go by: file names on one host, Redis keys on several.

A claim is named by the SHA-256 of its session id (`claim_name`), so no id can
name a path or a key pattern; its snapshot by the same name. Every Redis key
lives under one prefix per database (docs/design.md §3.9.1).
"""

from __future__ import annotations

import hashlib

__all__ = [
    "CLAIM_PREFIX",
    "EPOCH_KEY",
    "INDEXED_WORKERS_KEY",
    "INDEX_PREFIX",
    "KEY_PREFIX",
    "LOAD_KEY",
    "REGISTRATION_PREFIX",
    "SNAPSHOT_KEY_PREFIX",
    "claim_name",
    "snapshot_key",
]

KEY_PREFIX = "gym_sessions:"
#: ``<prefix><claim name>``: the holder of a session and its private address.
CLAIM_PREFIX = KEY_PREFIX + "claim:"
#: ``<prefix><worker id>``: the claim names a worker holds.
INDEX_PREFIX = KEY_PREFIX + "claims_of:"
#: The workers with such an index.
INDEXED_WORKERS_KEY = KEY_PREFIX + "indexed_workers"
#: ``<prefix><worker id>``: a live worker's private TCP address.
REGISTRATION_PREFIX = KEY_PREFIX + "worker:"
#: One lifetime of Redis's data.
EPOCH_KEY = KEY_PREFIX + "epoch"
#: Every worker's load, for placement.
LOAD_KEY = KEY_PREFIX + "load"
#: ``<prefix><claim name>``: a durable session's snapshot (beside its claim).
SNAPSHOT_KEY_PREFIX = KEY_PREFIX + "snapshot:"


def claim_name(session_id: str) -> str:
    """A claim's name in a store: a hash, so no id can name a path or a key pattern."""
    return hashlib.sha256(session_id.encode()).hexdigest()


def snapshot_key(session_id: str) -> str:
    """The Redis key of ``session_id``'s snapshot."""
    return SNAPSHOT_KEY_PREFIX + claim_name(session_id)
