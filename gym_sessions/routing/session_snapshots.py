"""Durable sessions: a live session's snapshot beside its claim, and its restore (design §3.14).

With ``--durable-sessions`` the holder writes a snapshot of every live session
a request changed *before* that request's reply goes out, so what a client saw
is what a restore gives back. When the holder has died (its private socket
refuses and its process is gone; with Redis: its registration lapsed and its
address refuses), the worker that accepted the next request for the session
takes its claim over (`FileClaimStore.take_over`, `RedisClaimStore.take_over`:
exactly one worker wins), rebuilds the session from the snapshot and serves
the request.

The snapshots themselves (their signed format, the file and Redis stores) are
`gym_sessions.routing.snapshot_store`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from gym_sessions.routing.owned_claims import ClaimState, OwnedClaims
from gym_sessions.routing.snapshot_store import Snapshot, SnapshotCodec, SnapshotStore

__all__ = [
    "DEFAULT_MAX_SNAPSHOT_BYTES",
    "RestoreOutcome",
    "SessionSnapshots",
]

logger = logging.getLogger("gym_sessions.routing")

DEFAULT_MAX_SNAPSHOT_BYTES = 8 * 1024 * 1024


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
