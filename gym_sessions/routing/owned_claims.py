"""A worker's own claims and their lifetimes (docs/design.md §3.4.3).

The holder keeps its claims in memory, so a request for one of its own
sessions never asks the store. Each claim is in one `ClaimState` and counts the
requests for it in flight; every change of state is a row of `TRANSITIONS`. A
background sweep ends the claims whose session has not been open for
``window`` seconds since its last request, even when no request comes. Only the
holder removes a claim, and never while a request for it is in flight.

For a store whose claims expire by themselves (Redis), the store follows the
memory (`StoreExpiry`): a claim that is open or has a request in flight has no
expiry; one that is idle and not open expires ``window`` plus a margin after
its last request, so the holder's own sweep always ends it first and the
expiry only matters when the holder died. One task per claim at a time brings
the store in line, so two requests can never leave it in the wrong order.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gym_sessions.errors import ClaimsUnavailableError, SessionConflictError, SessionGoneError
from gym_sessions.routing.claim_store import ClaimStore
from gym_sessions.routing.incarnations import Incarnation
from gym_sessions.routing.owner_cache import OwnerCache

__all__ = [
    "EXPIRY_MARGIN_SECONDS",
    "TRANSITIONS",
    "ClaimEvent",
    "ClaimState",
    "OwnedClaims",
    "RoomReservation",
    "StoreExpiry",
]

logger = logging.getLogger("gym_sessions.routing")

# How much later than the holder's own sweep a store's expiry ends an idle
# claim: longer than a sweep interval plus a store round trip, with room to spare.
EXPIRY_MARGIN_SECONDS = 10.0


class ClaimState(enum.Enum):
    """Where a claim this worker holds is in its life."""

    #: Held, session not open yet: a start in progress (or one that failed or
    #: was never made), or a provisional claim for a cookie naming an unheld id.
    CLAIMED = "claimed"
    #: A live session: counts toward ``max_sessions`` and idles out.
    OPEN = "open"
    #: Kept open for a record only (an agent's close receipt or failed seed); not live.
    RECORD = "record"
    #: Closed, verified or ended: ends ``window`` seconds after its last request.
    CLOSED = "closed"
    #: Ends as soon as its requests in flight finish.
    RELEASING = "releasing"
    #: Taken over from a dead holder (durable sessions): the session is being
    #: rebuilt from its snapshot; `RESTORED` makes it OPEN, `RESTORE_FAILED` ends it.
    RESTORING = "restoring"
    #: Gone from memory (and its store key removed, unless another worker holds it).
    ENDED = "ended"

    @property
    def live(self) -> bool:
        """A live session: counts toward ``max_sessions`` and idles out."""
        return self is ClaimState.OPEN

    @property
    def open(self) -> bool:
        """The claim lasts as long as the state does (no window runs)."""
        return self in (ClaimState.OPEN, ClaimState.RECORD)

    @property
    def should_expire(self) -> bool:
        """Not open: the sweep ends it ``window`` after its last request.

        A store with expiry lets such a claim expire a margin later, once no
        request for it is in flight (`_Claim.wanted_expiry`).
        """
        return self in (ClaimState.CLAIMED, ClaimState.CLOSED, ClaimState.RELEASING)


class StoreExpiry(enum.Enum):
    """What a store whose claims expire (Redis) was told about one claim."""

    #: No expiry in the store.
    HELD = "held"
    #: Told to expire ``window + EXPIRY_MARGIN_SECONDS`` after the last request.
    EXPIRING = "expiring"
    #: Not known: adopted after a failed removal, or written back after Redis
    #: lost its data. The next request (or sync) must hold it first.
    UNKNOWN = "unknown"


class ClaimEvent(enum.Enum):
    """What happens to a claim; `TRANSITIONS` says where each event takes each state."""

    MARK_OPEN_LIVE = "mark_open(live=True)"
    MARK_OPEN_RECORD = "mark_open(live=False)"
    MARK_NOT_OPEN = "mark_not_open"
    #: `OwnedClaims.release_now` with no request in flight.
    RELEASE_NOW = "release_now"
    #: `OwnedClaims.release_now` with requests in flight.
    RELEASE_WHEN_IDLE = "release_now, requests in flight"
    #: `OwnedClaims.leave` of the last request in flight.
    LAST_REQUEST_LEFT = "last request left"
    #: The sweep: ``window`` seconds since the last request, none in flight.
    WINDOW_PASSED = "window passed"
    #: The sweep: a live session had no request for ``idle_timeout`` seconds.
    IDLE_TIMEOUT = "idle timeout"
    #: The store says another worker holds the claim now (a renewal, or a restore).
    TAKEN_ELSEWHERE = "taken elsewhere"
    #: A taken-over session was rebuilt from its snapshot (`OwnedClaims.restored`).
    RESTORED = "restored"
    #: A taken-over session could not be rebuilt (`OwnedClaims.restore_failed`).
    RESTORE_FAILED = "restore failed"


def _transition_table() -> Mapping[tuple[ClaimState, ClaimEvent], ClaimState]:
    S, E = ClaimState, ClaimEvent
    held = (S.CLAIMED, S.OPEN, S.RECORD, S.CLOSED, S.RELEASING, S.RESTORING)
    table = {
        # The session started, or an agent's seed registered: a live session.
        # From OPEN it is a restart; from RECORD or CLOSED a start of the id again.
        (S.CLAIMED, E.MARK_OPEN_LIVE): S.OPEN,
        (S.OPEN, E.MARK_OPEN_LIVE): S.OPEN,
        (S.RECORD, E.MARK_OPEN_LIVE): S.OPEN,
        (S.CLOSED, E.MARK_OPEN_LIVE): S.OPEN,
        (S.RELEASING, E.MARK_OPEN_LIVE): S.OPEN,
        # Kept for a record only (an agent's close receipt or failed seed).
        (S.CLAIMED, E.MARK_OPEN_RECORD): S.RECORD,
        (S.RECORD, E.MARK_OPEN_RECORD): S.RECORD,
        (S.CLOSED, E.MARK_OPEN_RECORD): S.RECORD,
        (S.RELEASING, E.MARK_OPEN_RECORD): S.RECORD,
        # A live session closed with a record kept (an agent's close receipt):
        # no longer live, so it stops counting toward max_sessions at once.
        (S.OPEN, E.MARK_OPEN_RECORD): S.RECORD,
        # Closed, verified or ended: the window runs from its last request.
        (S.CLAIMED, E.MARK_NOT_OPEN): S.CLOSED,
        (S.OPEN, E.MARK_NOT_OPEN): S.CLOSED,
        (S.RECORD, E.MARK_NOT_OPEN): S.CLOSED,
        (S.CLOSED, E.MARK_NOT_OPEN): S.CLOSED,
        # Already promised to end with its last request; closing does not undo that.
        (S.RELEASING, E.MARK_NOT_OPEN): S.RELEASING,
        **{(state, E.RELEASE_NOW): S.ENDED for state in held},
        **{(state, E.RELEASE_WHEN_IDLE): S.RELEASING for state in held},
        (S.RELEASING, E.LAST_REQUEST_LEFT): S.ENDED,
        (S.CLAIMED, E.WINDOW_PASSED): S.ENDED,
        (S.CLOSED, E.WINDOW_PASSED): S.ENDED,
        # Only when `enter` refused the last request of a releasing claim: no
        # `leave` comes, so the window ends it like any claim that is not open.
        (S.RELEASING, E.WINDOW_PASSED): S.ENDED,
        (S.OPEN, E.IDLE_TIMEOUT): S.CLOSED,
        **{(state, E.TAKEN_ELSEWHERE): S.ENDED for state in held},
        # A takeover (durable sessions) enters RESTORING from no claim; the
        # rebuild is synchronous, so no request and no sweep sees it meanwhile.
        (S.RESTORING, E.RESTORED): S.OPEN,
        (S.RESTORING, E.RESTORE_FAILED): S.ENDED,
    }
    return MappingProxyType(table)


#: ``(state, event) -> new state`` for every change a claim may make; any pair
#: not here is refused (`OwnedClaims` logs it as an error). ENDED is final.
TRANSITIONS: Mapping[tuple[ClaimState, ClaimEvent], ClaimState] = _transition_table()


@dataclass
class _Claim:
    idle_since: float
    # Who the session belongs to: lives and ends with the claim, so an id whose
    # claim ended starts a new incarnation that no earlier credential reaches.
    incarnation: Incarnation = field(default_factory=Incarnation)
    state: ClaimState = ClaimState.CLAIMED
    # Requests between `enter` and `leave`; a claim never ends while any is.
    in_flight: int = 0
    # Store side (stores with expiry only), and the lock one task at a time
    # holds while bringing the store in line.
    expiry: StoreExpiry = StoreExpiry.HELD
    lock: asyncio.Lock | None = None
    # Set once a RESTORING claim's restore ended (either way); requests wait for it.
    restore_done: asyncio.Event | None = None

    @property
    def wanted_expiry(self) -> StoreExpiry:
        """What the store should hold for this claim now."""
        if self.state.should_expire and self.in_flight == 0:
            return StoreExpiry.EXPIRING
        return StoreExpiry.HELD


@dataclass(eq=False)
class RoomReservation:
    """Room one session start took on this worker, until its session opens or the start ends.

    Attributes:
        session_id: The session being started.
        active: Still holds room (an inactive one holds none: not needed, or handed over).
    """

    session_id: str
    active: bool = True


def _always() -> bool:
    return True


class OwnedClaims:
    """The claims this worker holds, on top of the shared `ClaimStore`.

    Args:
        store: The shared claim store.
        worker_id: This worker's id.
        window: ``session_close_retry_window_seconds``.
        clock: Monotonic clock (tests may pass their own).
        standing: Whether this worker may still serve its claims from memory.
            With Redis claims it turns false once the store has been out of
            reach so long that others may have taken them over.
        max_sessions: Live sessions this worker may hold (0: no limit); session
            starts beyond it find no room here (`reserve_room`).
        idle_timeout: Seconds a live session may go without a request before
            the idle hooks end it (0: never).
        owner_cache: Remembers other workers' claims the store named
            (`cached_holder`); only for forwards the holder checks (Redis claims).
    """

    def __init__(
        self,
        store: ClaimStore,
        worker_id: str,
        window: float,
        clock: Callable[[], float] = time.monotonic,
        standing: Callable[[], bool] | None = None,
        max_sessions: int = 0,
        idle_timeout: float = 0.0,
        owner_cache: OwnerCache | None = None,
    ) -> None:
        self.owner_cache = owner_cache
        self.store = store
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        #: False while the worker drains: new sessions go to other workers.
        self.accepting_sessions = True
        # Claims in a live state (`ClaimState.live`); kept by `_transition` alone.
        self._live = 0
        # Room taken by starts in flight, until their session opens or they end.
        self._reservations: dict[str, list[RoomReservation]] = {}
        self._reserved = 0
        self._idle_hooks: list[Callable[[str], None]] = []
        self.standing = standing or _always
        self.worker_id = worker_id
        self.window = window
        self._clock = clock
        self._claims: dict[str, _Claim] = {}
        self._release_hooks: list[Callable[[str], None]] = []
        # Told whenever the number of claims or of live sessions may have changed.
        self._count_hooks: list[Callable[[], None]] = []
        # Removals from the store that are under way, and ones the store
        # refused (it was unreachable) for the sweep to retry.
        self._removing: dict[str, asyncio.Task[None]] = {}
        self._unremoved: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        # Takeovers whose store call is under way: the store may already name
        # this worker (others forward here at once) before the claim is in
        # memory; `claim` waits for the outcome rather than adopt it as new.
        self._taking_over: dict[str, asyncio.Event] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    def on_release(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(session_id)`` whenever a claim of this worker ends."""
        self._release_hooks.append(hook)

    def on_count_change(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` whenever ``len(self)``, `live_sessions` or `load` may have changed."""
        self._count_hooks.append(hook)

    def on_idle(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(session_id)`` when a live session idled out; it must end the session."""
        self._idle_hooks.append(hook)

    @property
    def live_sessions(self) -> int:
        """Live sessions this worker holds (see `mark_open`)."""
        return self._live

    @property
    def load(self) -> int:
        """Live sessions plus starts under way here: what balanced placement compares."""
        return self._live + self._reserved

    @property
    def full(self) -> bool:
        """Whether a new session start would find no room here (`reserve_room`)."""
        return 0 < self.max_sessions <= self._live + self._reserved

    def live_session_ids(self) -> list[str]:
        """Ids of the live sessions this worker holds."""
        return [sid for sid, claim in self._claims.items() if claim.state.live]

    def in_flight(self, session_id: str) -> int:
        """Requests for ``session_id`` being served here now (0 if not held)."""
        claim = self._claims.get(session_id)
        return 0 if claim is None else claim.in_flight

    def state(self, session_id: str) -> ClaimState:
        """The state of this worker's claim of ``session_id`` (`ClaimState.ENDED` if none)."""
        claim = self._claims.get(session_id)
        return ClaimState.ENDED if claim is None else claim.state

    def reserve_room(self, session_id: str) -> RoomReservation | None:
        """Take room for a start of ``session_id``; ``None`` if this worker is full or draining.

        A restart of a live session here needs no room (the reservation is
        inactive). Without a limit a start still holds its room, so that
        `load` counts starts under way (balanced placement reads it). The room
        passes to the session when `mark_open` makes it live; `give_back_room`
        returns it otherwise.
        """
        claim = self._claims.get(session_id)
        if claim is not None and claim.state.live:
            return RoomReservation(session_id, active=False)
        if not self.accepting_sessions:
            return None
        if 0 < self.max_sessions <= self._live + self._reserved:
            return None
        reservation = RoomReservation(session_id)
        self._reservations.setdefault(session_id, []).append(reservation)
        self._reserved += 1
        self._counts_changed()
        return reservation

    def give_back_room(self, reservation: RoomReservation) -> None:
        """The start that took ``reservation`` is over: its room is free again (if still held)."""
        if not reservation.active:
            return
        reservation.active = False
        self._reserved -= 1
        held = self._reservations[reservation.session_id]
        held.remove(reservation)
        if not held:
            del self._reservations[reservation.session_id]
        self._counts_changed()

    def holds(self, session_id: str) -> bool:
        """Whether this worker holds the claim and means to keep it past this request."""
        claim = self._claims.get(session_id)
        return claim is not None and claim.state is not ClaimState.RELEASING

    async def holder(self, session_id: str) -> str | None:
        """The worker that claims ``session_id``: this one from memory, others from the store.

        Raises:
            ClaimsUnavailableError: the store cannot be reached.
        """
        await self._takeover_settled(session_id)
        if session_id in self._claims:
            return self.worker_id
        await self._removed(session_id)
        holder = await self.store.read(session_id)
        if holder == self.worker_id and self._took_over_meanwhile(session_id):
            await self._takeover_settled(session_id)
            return await self.holder(session_id)
        if self.owner_cache is not None:
            if holder is None or holder == self.worker_id:
                self.owner_cache.forget(session_id)
            else:
                self.owner_cache.put(session_id, holder)
        return holder

    def cached_holder(self, session_id: str) -> str | None:
        """Another worker a recent `holder` lookup named for ``session_id``, or ``None``.

        Never this worker (its own claims are in memory): a forward on this
        answer must let the holder refuse if it no longer holds the session.
        """
        if self.owner_cache is None or session_id in self._claims:
            return None
        return self.owner_cache.get(session_id)

    def forget_holder(self, session_id: str) -> None:
        """Drop the cached holder of ``session_id`` (closed, refused, gone)."""
        if self.owner_cache is not None:
            self.owner_cache.forget(session_id)

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        """Take the claim of a dead holder over (durable sessions); ``None`` if this worker won.

        The claim starts RESTORING here, with a placeholder incarnation that
        `restored` replaces by the snapshot's. Otherwise returns the worker
        that holds the claim now: this worker's id if another of its requests
        won (its restore may still run: `enter` waits for it), ``dead_holder``
        if nobody could take it.
        """
        await self._takeover_settled(session_id)
        if session_id in self._claims:
            return self.worker_id  # another request of ours took it over (or is restoring it)
        decided = asyncio.Event()
        self._taking_over.setdefault(session_id, decided)
        try:
            other = await self.store.take_over(session_id, dead_holder)
            if other is not None:
                return other
            if session_id in self._claims:
                # Cannot happen: the store lets one taker win, and a request of
                # ours that won meanwhile would have made the store answer our id.
                logger.error("session %r was taken over twice by this worker", session_id)
                return self.worker_id
            self._claims[session_id] = _Claim(
                idle_since=self._clock(), state=ClaimState.RESTORING, restore_done=asyncio.Event()
            )
            return None
        finally:
            if self._taking_over.get(session_id) is decided:
                del self._taking_over[session_id]
            decided.set()

    async def _takeover_settled(self, session_id: str) -> None:
        """Wait while a takeover of ``session_id`` by this worker awaits the store.

        The store names this worker the moment its takeover script ran, before
        the reply reaches us and the claim (RESTORING) is in memory: a store
        read, a second takeover or a claim made in that gap would see our own
        id without our claim and serve, adopt or refuse the session wrongly
        (an empty session, 409 or 410). After the wait, memory and store agree.
        """
        while (taking := self._taking_over.get(session_id)) is not None:
            await taking.wait()

    def _took_over_meanwhile(self, session_id: str) -> bool:
        """Whether a takeover of ours began while a store call for ``session_id`` was out.

        Then the call may have seen the takeover's claim (our id) before memory
        has it: the caller waits (`_takeover_settled`) and asks again.
        """
        return session_id in self._taking_over and session_id not in self._claims

    def restored(self, session_id: str, incarnation: Incarnation) -> None:
        """The taken-over session was rebuilt: live here under its old incarnation."""
        claim = self._claims.get(session_id)
        if claim is None:
            return
        claim.incarnation = incarnation
        self._transition(session_id, claim, ClaimEvent.RESTORED)
        if claim.restore_done is not None:
            claim.restore_done.set()

    def restore_failed(self, session_id: str) -> None:
        """The taken-over session could not be rebuilt: end the claim (and its snapshot)."""
        claim = self._claims.get(session_id)
        if claim is not None:
            self._release(session_id, claim, ClaimEvent.RESTORE_FAILED)
            if claim.restore_done is not None:
                claim.restore_done.set()

    def incarnation(self, session_id: str) -> Incarnation:
        """The incarnation of a session this worker claims (see `session_access`)."""
        return self._claims[session_id].incarnation

    async def claim(self, session_id: str, incarnation: Incarnation | None = None) -> str | None:
        """Claim ``session_id`` here; ``None`` on success, else the other holder's id.

        Args:
            session_id: The id.
            incarnation: The incarnation a new claim starts (a fresh, unbound
                one by default); ignored when this worker already holds the id.

        Raises:
            ClaimsUnavailableError: the store cannot be reached.
        """
        await self._takeover_settled(session_id)
        if session_id in self._claims:
            return None
        await self._removed(session_id)
        # From here the sweep must not retry an old removal of this id: it
        # could land after our create and delete the claim we are taking.
        self._unremoved.discard(session_id)
        other = await self.store.create(session_id)
        if other == self.worker_id and self._took_over_meanwhile(session_id):
            await self._takeover_settled(session_id)
            return await self.claim(session_id, incarnation)
        if other is None or other == self.worker_id:
            if session_id not in self._claims:  # a concurrent claim may have won the await
                # Our own id back: a claim of ours the store kept after this
                # worker let go of it (its removal failed), maybe with an
                # expiry, so the first request must hold it again.
                adopted = other == self.worker_id and self.store.expires
                self._claims[session_id] = _Claim(
                    idle_since=self._clock(),
                    incarnation=incarnation or Incarnation(),
                    expiry=StoreExpiry.UNKNOWN if adopted else StoreExpiry.HELD,
                )
                self._counts_changed()
            return None
        return other

    async def enter(self, session_id: str) -> None:
        """A request for a claimed session starts being served here.

        Raises:
            SessionConflictError: the store's expiry ended the claim while this
                worker was stalled and another worker claimed it since.
            ClaimsUnavailableError: this worker cannot vouch for its claims any
                more (`standing`).
        """
        if not self.standing():
            raise ClaimsUnavailableError(
                "this worker has been cut off from the claim store for too long to know "
                "that it still holds its sessions"
            )
        claim = self._claims[session_id]
        if claim.restore_done is not None and not claim.restore_done.is_set():
            # Taken over, being rebuilt (durable sessions): never serve before.
            await claim.restore_done.wait()
            if self._claims.get(session_id) is not claim:
                raise SessionGoneError(
                    f"session {session_id!r} could not be restored after its worker died"
                )
        claim.in_flight += 1
        if claim.expiry is StoreExpiry.HELD:
            return
        await self._sync_store(session_id, claim)
        if self._claims.get(session_id) is not claim:
            claim.in_flight -= 1
            raise SessionConflictError(
                f"session {session_id!r} expired in the claim store and was claimed elsewhere"
            )
        if claim.expiry is not StoreExpiry.HELD:
            # Not held in the store: its expiry may run out under this request
            # and another worker take the session. Refuse rather than serve.
            claim.in_flight -= 1
            raise ClaimsUnavailableError(
                f"the claim of session {session_id!r} could not be renewed in the claim store"
            )

    async def leave(self, session_id: str) -> None:
        """A request entered with `enter` is done."""
        claim = self._claims.get(session_id)
        if claim is None:
            return
        claim.in_flight -= 1
        claim.idle_since = self._clock()
        if claim.in_flight:
            return
        if claim.state is ClaimState.RELEASING:
            self._release(session_id, claim, ClaimEvent.LAST_REQUEST_LEFT)
        elif self.store.expires and claim.expiry is not claim.wanted_expiry:
            await self._sync_store(session_id, claim)

    def mark_open(self, session_id: str, *, live: bool = True) -> None:
        """The session started successfully: its claim lasts until it stops being open.

        Args:
            session_id: The session.
            live: A live session (counts toward `max_sessions`, idles out);
                ``False`` keeps the claim for a record only (an agent's receipt).
        """
        claim = self._claims.get(session_id)
        if claim is None:
            return
        was_live = claim.state.live
        event = ClaimEvent.MARK_OPEN_LIVE if live else ClaimEvent.MARK_OPEN_RECORD
        if not self._transition(session_id, claim, event):
            return
        if claim.state.live and not was_live:
            held = self._reservations.get(session_id)
            if held:
                # The room its start reserved is the live session's own now.
                self.give_back_room(held[0])
        self._sync_later(session_id, claim)

    def mark_not_open(self, session_id: str) -> None:
        """The session was closed, verified or ended: its window starts after its last request."""
        claim = self._claims.get(session_id)
        if claim is not None:
            self._close(session_id, claim, ClaimEvent.MARK_NOT_OPEN)

    def _close(self, session_id: str, claim: _Claim, event: ClaimEvent) -> None:
        if self._transition(session_id, claim, event):
            claim.idle_since = self._clock()
            self._sync_later(session_id, claim)

    def drop_unclaimed_state(self, session_id: str) -> None:
        """Run the release hooks for a session this worker served but could not claim.

        A handler may have created state for it before another worker's claim
        turned the reply into a 409; nothing would ever release that state.
        """
        if session_id not in self._claims:
            self._run_release_hooks(session_id)

    def release_now(self, session_id: str) -> None:
        """End the claim at once, or as soon as its last in-flight request is done.

        For servers that decide a claim's end themselves: an agent whose seed
        created nothing, or that dropped a session's last record.
        """
        claim = self._claims.get(session_id)
        if claim is None:
            return
        if claim.in_flight == 0:
            self._release(session_id, claim, ClaimEvent.RELEASE_NOW)
        else:
            self._transition(session_id, claim, ClaimEvent.RELEASE_WHEN_IDLE)

    def sweep(self) -> list[str]:
        """End every claim whose window has passed; returns the ended session ids.

        Also retries store work that failed while the store was unreachable.
        """
        now = self._clock()
        if self.idle_timeout > 0:
            self._end_idle_sessions(now - self.idle_timeout)
        deadline = now - self.window
        due = [
            (sid, claim)
            for sid, claim in self._claims.items()
            if claim.state.should_expire and claim.in_flight == 0 and claim.idle_since <= deadline
        ]
        expired = []
        for sid, claim in due:
            # A release hook of an earlier one may have ended it already.
            if self._claims.get(sid) is claim and self._release(
                sid, claim, ClaimEvent.WINDOW_PASSED
            ):
                expired.append(sid)
        for sid in list(self._unremoved):
            if sid not in self._removing:
                self._start_removal(sid)
        if self.store.expires:
            for sid, claim in self._claims.items():
                if claim.in_flight == 0 and claim.expiry is not claim.wanted_expiry:
                    self._sync_later(sid, claim)
        return expired

    def _end_idle_sessions(self, deadline: float) -> None:
        idle = [
            sid
            for sid, claim in self._claims.items()
            if claim.state.live and claim.in_flight == 0 and claim.idle_since <= deadline
        ]
        for sid in idle:
            for hook in self._idle_hooks:
                try:
                    hook(sid)
                except Exception:
                    logger.exception("ending idle session %r failed", sid)
            # Whatever the hooks did, it no longer counts as live. A record they
            # kept (an agent's receipt) stays until its holder drops it.
            claim = self._claims.get(sid)
            if claim is not None and claim.state.live:
                self._close(sid, claim, ClaimEvent.IDLE_TIMEOUT)

    def _transition(self, session_id: str, claim: _Claim, event: ClaimEvent) -> bool:
        """Move ``claim`` to where `TRANSITIONS` takes it on ``event``; ``False`` if refused.

        The one place a claim changes state: it keeps the live count, and takes
        an ENDED claim out of memory (its store key is the caller's business).
        """
        new = TRANSITIONS.get((claim.state, event))
        if new is None:
            # Refused and logged, not raised: the callers are paths that must run
            # to their end (`leave` in the router's `finally`, the sweep over every
            # claim, idle hooks, background store syncs). An exception there would
            # strand a request count, stop every later sweep at the same claim,
            # or turn a served reply into a 500. Refused, the claim keeps its
            # state, a defined one whose invariants (one holder, no end under a
            # request, no store expiry while open) still hold: at worst it lives
            # longer than it should, and this error says why.
            logger.error(
                "claim of session %r: %s is not defined in state %s; refused",
                session_id,
                event.name,
                claim.state.name,
                stack_info=True,
            )
            return False
        changed = new.live != claim.state.live
        if changed:
            self._live += 1 if new.live else -1
        claim.state = new
        if new is ClaimState.ENDED and self._claims.get(session_id) is claim:
            del self._claims[session_id]
            changed = True
        if changed:
            self._counts_changed()
        return True

    def _counts_changed(self) -> None:
        for hook in self._count_hooks:
            try:
                hook()
            except Exception:  # a metrics failure must not break a claim's change
                logger.exception("a claim count hook failed")

    def _release(self, session_id: str, claim: _Claim, event: ClaimEvent) -> bool:
        """End the claim on ``event``: out of memory, out of the store, state released."""
        if not self._transition(session_id, claim, event):
            return False
        self._start_removal(session_id)
        self._run_release_hooks(session_id)
        return True

    def _end_taken(self, session_id: str, claim: _Claim) -> None:
        """The store says another worker holds the claim: end it here, leave its key alone."""
        if self._transition(session_id, claim, ClaimEvent.TAKEN_ELSEWHERE):
            self._run_release_hooks(session_id)

    def _start_removal(self, session_id: str) -> None:
        self._unremoved.discard(session_id)
        task = asyncio.ensure_future(self._remove(session_id))
        self._removing[session_id] = task

    async def _remove(self, session_id: str) -> None:
        try:
            await self.store.remove(session_id)
        except ClaimsUnavailableError:
            self._unremoved.add(session_id)
        except Exception:
            logger.exception("removing the claim of session %r failed", session_id)
            self._unremoved.add(session_id)
        finally:
            self._removing.pop(session_id, None)

    async def _removed(self, session_id: str) -> None:
        """Wait until this worker's removal of ``session_id``, if one is under way, is done."""
        task = self._removing.get(session_id)
        if task is not None:
            await asyncio.shield(task)

    def _sync_later(self, session_id: str, claim: _Claim) -> None:
        if self.store.expires and claim.in_flight == 0:
            task = asyncio.ensure_future(self._sync_store(session_id, claim))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _sync_store(self, session_id: str, claim: _Claim) -> None:
        """Bring the store's expiry of this claim in line with its memory.

        One task at a time per claim (its lock), each looping until the store
        matches, so two requests can never leave the store in the wrong order.
        An UNKNOWN expiry never matches, so it is always written once.
        """
        if claim.lock is None:
            claim.lock = asyncio.Lock()
        async with claim.lock:
            try:
                while self._claims.get(session_id) is claim:
                    wanted = claim.wanted_expiry
                    if claim.expiry is wanted:
                        return
                    if wanted is StoreExpiry.EXPIRING:
                        seconds = self.window + EXPIRY_MARGIN_SECONDS
                        kept = await self.store.expire(session_id, seconds)
                    else:
                        kept = await self.store.hold(session_id)
                    if not kept:
                        # Unless the claim ended here meanwhile (then the id may
                        # be another claim's now, which this reply is not about).
                        if self._claims.get(session_id) is claim:
                            logger.error(
                                "the claim of session %r expired and was taken", session_id
                            )
                            self._end_taken(session_id, claim)
                        return
                    claim.expiry = wanted
            except ClaimsUnavailableError:
                # Nobody can claim while the store is unreachable; the sweep
                # retries (the heartbeat reports the outage, once per beat).
                logger.debug("claim store unreachable: expiry of %r not updated", session_id)

    async def restore(self, concurrency: int = 32) -> int:
        """Write every claim this worker holds back into the store (after it lost its data).

        Returns how many claims another worker had taken meanwhile; those are
        dropped here (their state released), since the other worker now serves
        them. Up to ``concurrency`` claims are written at a time.
        """
        lost = 0
        slots = asyncio.Semaphore(concurrency)

        async def write_back(sid: str, claim: _Claim) -> None:
            nonlocal lost
            async with slots:
                if self._claims.get(sid) is not claim:
                    return  # released meanwhile: nothing to write back
                other = await self.store.create(sid, restoring=True)
            if self._claims.get(sid) is not claim:
                if other is None:  # released while we wrote it: take it out again
                    self._start_removal(sid)
                return
            if other is not None and other != self.worker_id:
                lost += 1
                self._end_taken(sid, claim)
                return
            # What the store holds is unknown (a fresh key, or one a reader gave
            # an orphan's expiry): one update to what the claim needs.
            claim.expiry = StoreExpiry.UNKNOWN
            async with slots:
                await self._sync_store(sid, claim)

        results = await asyncio.gather(
            *[write_back(sid, claim) for sid, claim in list(self._claims.items())],
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise failures[0]
        return lost

    def _run_release_hooks(self, session_id: str) -> None:
        for hook in self._release_hooks:
            try:
                hook(session_id)
            except Exception:
                logger.exception("releasing the state of session %r failed", session_id)

    async def run_sweeper(self) -> None:
        """Sweep in the background until cancelled."""
        interval = min(1.0, max(0.02, self.window / 10))
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except Exception:  # a failing store must not stop every later sweep
                logger.exception("sweeping expired claims failed")

    async def wait_for_store(self) -> None:
        """Wait for store work under way (removals, expiry updates); for shutdown and tests."""
        pending = [*self._removing.values(), *self._tasks]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
