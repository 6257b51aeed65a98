"""Durable sessions: a live session's snapshot beside its claim, and its restore (design §3.14).

With ``--durable-sessions`` the holder writes a snapshot of every live session
a request changed *before* that request's reply goes out, so what a client saw
is what a restore gives back. When the holder has died (its private socket
refuses and its process is gone; with Redis: its registration lapsed and its
address refuses), the worker that accepted the next request for the session
takes its claim over (`FileClaimStore.take_over`, `RedisClaimStore.take_over`:
exactly one worker wins), rebuilds the session from the snapshot and serves
the request.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast

from gym_sessions.routing.claim_store import claim_name
from gym_sessions.routing.owned_claims import ClaimState, OwnedClaims
from gym_sessions.routing.session_access import Incarnation

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "FileSnapshotStore",
    "RedisSnapshotStore",
    "RestoreOutcome",
    "SessionSnapshots",
    "Snapshot",
    "SnapshotCodec",
    "SnapshotStore",
    "snapshot_key",
]

logger = logging.getLogger("gym_sessions.routing")

DEFAULT_MAX_SNAPSHOT_BYTES = 8 * 1024 * 1024
_MAGIC = b"GSS1"
_MAC_BYTES = 32
_LENGTH = struct.Struct(">I")
_SLOT_LENGTH = struct.Struct(">Q")
#: Prefix of the Redis keys of snapshots (beside ``gym_sessions:claim:``).
SNAPSHOT_KEY_PREFIX = "gym_sessions:snapshot:"

_T = TypeVar("_T")


def snapshot_key(session_id: str) -> str:
    """The Redis key of ``session_id``'s snapshot."""
    return SNAPSHOT_KEY_PREFIX + claim_name(session_id)


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
        from gym_sessions.routing.redis_claims import call_redis

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


@dataclass(frozen=True)
class RestoreOutcome:
    """What `SessionSnapshots.restore` found.

    Attributes:
        restored: This worker holds the session now, rebuilt from its snapshot.
        holder: Otherwise, the worker that holds it now (another worker won the
            takeover, or this one, by another request), or ``None``: the
            session cannot be restored (410).
    """

    restored: bool
    holder: str | None = None


def _nothing() -> None:
    pass


class SessionSnapshots:
    """One worker's durable sessions: writes their snapshots and restores dead holders' ones.

    Args:
        store: Where snapshots live.
        claims: This worker's claims (a restore takes the claim over through them).
        codec: Signs and checks snapshots.
        export_session: The server's hook: the session's state as bytes, or
            ``None`` if it has none that can be captured.
        import_session: The server's hook: rebuild the session from those bytes.
        take_changed: The server's record of sessions a request changed
            (`SessionServer.take_changed`): only those are written again.
        max_bytes: A larger snapshot is not kept: the session is served but not
            durable (logged once per session).
        capturable: The server's sessions can be captured at all
            (`SessionServer.durability`); if not, nothing is written (the
            supervisor said so once at start-up) and no session is restored.
    """

    def __init__(
        self,
        store: SnapshotStore,
        claims: OwnedClaims,
        codec: SnapshotCodec,
        export_session: Callable[[str], bytes | None],
        import_session: Callable[[str, bytes], None],
        take_changed: Callable[[str], bool],
        max_bytes: int = DEFAULT_MAX_SNAPSHOT_BYTES,
        capturable: bool = True,
    ) -> None:
        self.take_changed = take_changed
        self.capturable = capturable
        self.store = store
        self.claims = claims
        self.codec = codec
        self.export_session = export_session
        self.import_session = import_session
        self.max_bytes = max_bytes
        # Sessions already logged as not durable (too large, or not capturable).
        self._logged: set[str] = set()
        # The number of each session's next snapshot here.
        self._next_seq: dict[str, int] = {}
        # Sessions whose snapshot holds their state as of their last reply.
        self._current: set[str] = set()
        self.restored_total = 0
        #: Told of each snapshot written and each session restored here (the
        #: operator metrics); no-ops until the app connects them.
        self.on_saved: Callable[[], None] = _nothing
        self.on_restored: Callable[[], None] = _nothing

    async def after_request(self, session_id: str, *, held: bool) -> None:
        """A request's reply is about to start: write the snapshot if the request changed it.

        ``held``: this worker holds the claim. A request served without the
        claim (its reply turned into a 409) must not touch the holder's snapshot.
        """
        if self.take_changed(session_id) and held and self.capturable:
            self._current.discard(session_id)
            await self.save(session_id)

    async def save(self, session_id: str) -> None:
        """Write the snapshot of a session a request changed (before its reply is sent).

        Only a live (`ClaimState.OPEN`) session held here has one; any other
        state removes it, so a closed or failed session is never brought back.
        """
        if self.claims.state(session_id) is not ClaimState.OPEN:
            self.forget(session_id)
            return
        try:
            session = self.export_session(session_id)
        except Exception:
            logger.exception("capturing session %r failed: it is not durable", session_id)
            session = None
        if session is None:
            self._not_durable(session_id, "its state cannot be captured")
            return
        seq = self._next_seq.get(session_id, 0)
        snapshot = Snapshot(self.claims.incarnation(session_id), session, seq)
        data = self.codec.encode(session_id, snapshot)
        if len(data) > self.max_bytes:
            self._not_durable(
                session_id, f"its snapshot ({len(data)} bytes) exceeds --max-snapshot-bytes"
            )
            return
        try:
            await self.store.save(session_id, data, seq)
            self._next_seq[session_id] = seq + 1
            self._current.add(session_id)
            self.on_saved()
        except Exception:
            # A stale snapshot would restore a state the client never saw last:
            # better none (410 if the worker dies) than that. The reply goes on.
            logger.exception("writing the snapshot of session %r failed", session_id)
            self.store.discard(session_id)

    def _not_durable(self, session_id: str, why: str) -> None:
        # An older snapshot must not outlive the state it no longer describes.
        self._current.discard(session_id)
        self.store.discard(session_id)
        if session_id not in self._logged:
            self._logged.add(session_id)
            logger.warning("session %r is served but not durable: %s", session_id, why)

    def can_hand_over(self) -> bool:
        """Whether every live session here could be restored elsewhere as it is now.

        Each has a snapshot of its state as of its last reply and no request in
        flight. A draining worker whose sessions all can leaves at once: the
        next request of each restores it on another worker (`WorkerApp.drained`).
        """
        if not self.capturable:
            return False
        return all(
            sid in self._current and self.claims.in_flight(sid) == 0
            for sid in self.claims.live_session_ids()
        )

    def forget(self, session_id: str) -> None:
        """The session's state is gone here (closed, expired): so is its snapshot."""
        self._logged.discard(session_id)
        self._next_seq.pop(session_id, None)
        self._current.discard(session_id)
        self.store.discard(session_id)

    async def _load(self, session_id: str) -> Snapshot | None:
        """The newest snapshot of the session that verifies, or ``None``."""
        candidates = await self.store.load(session_id, self.max_bytes)
        snapshots = [self.codec.decode(session_id, data) for data in candidates]
        valid = [snapshot for snapshot in snapshots if snapshot is not None]
        if candidates and not valid:
            logger.error(
                "no snapshot of session %r is signed with this server's secret: ignored",
                session_id,
            )
        return max(valid, key=lambda snapshot: snapshot.seq, default=None)

    async def restore(self, session_id: str, dead_holder: str) -> RestoreOutcome:
        """Take over ``session_id`` from ``dead_holder`` and rebuild it here from its snapshot.

        The caller established that ``dead_holder`` is gone. Without a valid
        snapshot nothing is touched (the session answers 410 as before).
        """
        if await self._load(session_id) is None:
            return RestoreOutcome(False)
        other = await self.claims.take_over(session_id, dead_holder)
        if other == self.claims.worker_id:
            # Another request of this worker won; `enter` waits for its restore.
            return RestoreOutcome(False, other)
        if other is not None:
            return RestoreOutcome(False, None if other == dead_holder else other)
        # Read again under our claim: the dead holder can no longer write it,
        # and every other taker lost, so this is the session's last state. (An
        # await: the claim is RESTORING meanwhile, which no event but the
        # restore's own ends; a request of this worker for the id waits in
        # `take_over`, see `OwnedClaims`.)
        snapshot = await self._load(session_id)
        try:
            if snapshot is None:
                raise ValueError("the snapshot vanished or stopped verifying")
            self.import_session(session_id, snapshot.session)
        except Exception:
            logger.exception("restoring session %r from its snapshot failed", session_id)
            self.claims.restore_failed(session_id)
            return RestoreOutcome(False)
        self.claims.restored(session_id, snapshot.incarnation)
        # Continue its numbering: the next write goes to the older slot.
        self._next_seq[session_id] = snapshot.seq + 1
        self._current.add(session_id)
        self.restored_total += 1
        self.on_restored()
        logger.info("session %r restored here from the snapshot of %s", session_id, dead_holder)
        return RestoreOutcome(True)

    async def may_take_over(self, refused_holder: str) -> bool:
        """Whether ``refused_holder``'s sessions may be taken over after it refused a hop.

        The hop never reached it, so nothing ran there; its process must have
        exited too (`ClaimStore.holder_exited`): a slow worker never is.
        """
        return await self.claims.store.holder_exited(refused_holder)

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        """The worker that serves a request of ``session_id`` now that ``dead_holder`` is gone.

        The rule every request follows, a ``/step`` and a step batch's entry
        alike (§3.14.3): this worker's id when the session is here now (this
        request restored it, or another of this worker's did); the winner's id
        when another worker won the takeover (forward there, once: a winner that
        died too is a 410, never a second restore); ``None`` when the session
        cannot be restored (410).
        """
        outcome = await self.restore(session_id, dead_holder)
        own = self.claims.worker_id
        if outcome.restored or session_id in self.claims:
            return own
        return outcome.holder if outcome.holder != own else None
