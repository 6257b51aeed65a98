"""Durable sessions' snapshots: their signed format and where they live (design §3.14.2).

A snapshot holds the session's `Incarnation` (so the client's cookie, token and
``session_key`` keep working, and nothing else starts to) and the bytes the
server's ``export_session`` gave. Its format (`SnapshotCodec`)::

    b"GSS1" | MAC (32 bytes) | header length (4 bytes, big endian) | header JSON | session bytes

The header is ``{"nonce": ..., "key_digest": hex or null, "bound": bool, "seq":
int}`` (``seq`` numbers the session's snapshots; the newest valid one wins). The
MAC is HMAC-SHA256 keyed by HMAC-SHA256(secret, ``"gym-sessions/session-snapshots"``)
over the claim name and everything after the MAC, each prefixed by its 8-byte
length: a snapshot cannot be forged, altered or moved to another session, and
one that does not verify is never decoded (the session bytes may be a pickle).

Snapshots live in ``<runtime dir>/snapshots/<claim name>.0`` and ``.1`` with
file claims (`FileSnapshotStore`: two slots overwritten in place, alternately,
mode 0600 in the 0700 runtime directory), or in ``gym_sessions:snapshot:<claim
name>`` with Redis claims (`RedisSnapshotStore`, base64). They end with their
claims (the stores' ``remove``). File snapshots survive the death of a
process, not of the host: they are not synced to disk.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import struct
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from gym_sessions.routing.incarnations import Incarnation
from gym_sessions.routing.keys import claim_name, snapshot_key
from gym_sessions.routing.redis_connection import call_redis

__all__ = [
    "FileSnapshotStore",
    "RedisSnapshotStore",
    "Snapshot",
    "SnapshotCodec",
    "SnapshotStore",
]

logger = logging.getLogger("gym_sessions.routing")

_MAGIC = b"GSS1"
_MAC_BYTES = 32
_LENGTH = struct.Struct(">I")
_SLOT_LENGTH = struct.Struct(">Q")

_T = TypeVar("_T")


@dataclass(frozen=True)
class Snapshot:
    """What a restore needs: who the session belongs to and the server's own state of it."""

    incarnation: Incarnation
    session: bytes
    #: Counts the session's snapshots (across takeovers): the newest one wins.
    seq: int = 0


class SnapshotCodec:
    """Encodes snapshots and decodes only those signed with this server's secret.

    Args:
        secret: The server secret; a key for snapshots alone is derived from it.
    """

    def __init__(self, secret: str) -> None:
        purpose = b"gym-sessions/session-snapshots"
        self._key = hmac.new(secret.encode(), purpose, hashlib.sha256).digest()

    def _mac(self, name: str, rest: bytes) -> bytes:
        message = b"".join(
            struct.pack(">Q", len(part)) + part for part in (b"snapshot", name.encode(), rest)
        )
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def encode(self, session_id: str, snapshot: Snapshot) -> bytes:
        """The signed bytes of ``snapshot`` of ``session_id``."""
        incarnation = snapshot.incarnation
        digest = incarnation.key_digest
        header = json.dumps(
            {
                "nonce": incarnation.nonce,
                "key_digest": None if digest is None else digest.hex(),
                "bound": incarnation.bound,
                "seq": snapshot.seq,
            },
            separators=(",", ":"),
        ).encode()
        rest = _LENGTH.pack(len(header)) + header + snapshot.session
        return _MAGIC + self._mac(claim_name(session_id), rest) + rest

    def decode(self, session_id: str, data: bytes) -> Snapshot | None:
        """The snapshot in ``data``, or ``None`` if it is not one of ``session_id`` signed here."""
        head = len(_MAGIC) + _MAC_BYTES
        if len(data) < head + _LENGTH.size or not data.startswith(_MAGIC):
            return None
        mac, rest = data[len(_MAGIC) : head], data[head:]
        if not hmac.compare_digest(mac, self._mac(claim_name(session_id), rest)):
            return None
        (length,) = _LENGTH.unpack_from(rest)
        try:
            header = json.loads(rest[_LENGTH.size : _LENGTH.size + length])
            digest = header["key_digest"]
            incarnation = Incarnation(
                nonce=str(header["nonce"]),
                key_digest=None if digest is None else bytes.fromhex(digest),
                bound=bool(header["bound"]),
            )
            seq = int(header["seq"])
        except (ValueError, KeyError, TypeError):
            return None  # signed by us but not readable: a bug, never a forgery
        return Snapshot(incarnation, rest[_LENGTH.size + length :], seq)


class SnapshotStore(Protocol):
    """Where snapshots live, next to the claims."""

    async def save(self, session_id: str, data: bytes, seq: int) -> None:
        """Write the session's snapshot number ``seq``; readers find it or an older one, whole."""

    async def load(self, session_id: str, limit: int) -> list[bytes]:
        """Every candidate snapshot of the session (none larger than ``limit``), unverified."""

    def discard(self, session_id: str) -> None:
        """Remove the snapshot, now or in a task that runs before the session's next `save`."""


class FileSnapshotStore:
    """Snapshots as files in the runtime directory's ``snapshots/`` (one host).

    Each session has two slot files, ``<claim name>.0`` and ``.1``; snapshot
    number ``seq`` overwrites slot ``seq % 2`` in place (``pwrite`` of an
    8-byte length and the snapshot; the file is never truncated), so the other
    slot always holds the one before, whole. A write cut short by the
    worker's death leaves a slot whose MAC fails: the reader takes the other
    one, which is the last state any client was answered from (that write's
    reply was never sent). In place, a write is a few microseconds; a new file
    and a rename per step cost hundreds (``benchmarks/durable_sessions.py``).
    """

    _SLOTS = (".0", ".1")

    def __init__(self, snapshots_dir: str) -> None:
        self.snapshots_dir = snapshots_dir

    def paths(self, session_id: str) -> list[str]:
        """Where ``session_id``'s snapshot slots live: named by the claim's hash, never the id."""
        base = os.path.join(self.snapshots_dir, claim_name(session_id))
        return [base + slot for slot in self._SLOTS]

    async def save(self, session_id: str, data: bytes, seq: int) -> None:
        self.save_now(session_id, data, seq)

    async def load(self, session_id: str, limit: int) -> list[bytes]:
        return self.load_now(session_id, limit)

    def discard(self, session_id: str) -> None:
        self.remove(session_id)

    def save_now(self, session_id: str, data: bytes, seq: int) -> None:
        """Write snapshot number ``seq`` into its slot, in place."""
        path = self.paths(session_id)[seq % 2]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            record = _SLOT_LENGTH.pack(len(data)) + data
            written = os.pwrite(fd, record, 0)
            if written != len(record):
                raise OSError(f"short write of a snapshot ({written} of {len(record)} bytes)")
        finally:
            os.close(fd)

    def load_now(self, session_id: str, limit: int) -> list[bytes]:
        """`load` without a coroutine."""
        found = []
        for path in self.paths(session_id):
            try:
                with open(path, "rb") as file:
                    head = file.read(_SLOT_LENGTH.size)
                    if len(head) < _SLOT_LENGTH.size:
                        continue
                    (length,) = _SLOT_LENGTH.unpack(head)
                    if length > limit:
                        continue
                    data = file.read(length)
            except FileNotFoundError:
                continue
            if len(data) == length:
                found.append(data)
        return found

    def remove(self, session_id: str) -> None:
        """Remove the snapshot's slots, if any."""
        for path in self.paths(session_id):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


class RedisSnapshotStore:
    """Snapshots as Redis keys beside the claims (several hosts).

    Redis is not trusted for integrity: only the MAC (`SnapshotCodec`) makes a
    snapshot count. Values are base64, since the claim clients decode replies.

    Args:
        client: The worker's Redis client (``decode_responses=True``).
        deadline: Seconds one call may take in all (``claims_timeout``).
        ttl_seconds: Expiry of a snapshot from its last write: no restore can
            need it later (its session would have idled out, or no credential
            reaches it any more), so a dead worker's snapshots never stay.
    """

    def __init__(self, client: Any, deadline: float, ttl_seconds: float) -> None:
        self.client = client
        self.deadline = deadline
        self.ttl_ms = max(1, int(ttl_seconds * 1000))
        # Removals not done yet, by session: a later save or load waits for them,
        # so a removal never lands after a newer snapshot.
        self._removing: dict[str, asyncio.Task[None]] = {}

    async def _call(self, operation: Awaitable[_T]) -> _T:
        return await call_redis(operation, self.deadline)

    async def _settled(self, session_id: str) -> None:
        task = self._removing.get(session_id)
        if task is not None:
            await asyncio.shield(task)

    async def save(self, session_id: str, data: bytes, seq: int) -> None:
        await self._settled(session_id)
        encoded = base64.b64encode(data).decode()
        await self._call(self.client.set(snapshot_key(session_id), encoded, px=self.ttl_ms))

    async def load(self, session_id: str, limit: int) -> list[bytes]:
        await self._settled(session_id)
        encoded = cast("str | None", await self._call(self.client.get(snapshot_key(session_id))))
        if encoded is None or len(encoded) > (limit + 2) // 3 * 4:
            return []
        try:
            return [base64.b64decode(encoded, validate=True)]
        except ValueError:
            return []  # not ours (Redis is not trusted): as if missing

    def discard(self, session_id: str) -> None:
        previous = self._removing.get(session_id)

        async def remove() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await self._call(self.client.delete(snapshot_key(session_id)))
            except Exception:
                # Redis unreachable: the snapshot expires on its own, and a
                # restore needs its claim to name a dead holder, which a closed
                # session's never will once the claim ends.
                logger.warning("removing the snapshot of session %r failed", session_id)
            finally:
                if self._removing.get(session_id) is task:
                    del self._removing[session_id]

        task = asyncio.ensure_future(remove())
        self._removing[session_id] = task
