"""The claim lifecycle (`ClaimState`, `StoreExpiry`, `TRANSITIONS`) and the Redis script protocol.

In process, on a fake clock: `OwnedClaims` over `LocalClaimStore`, or over
`ExpiringStore`, a few lines standing in for a store whose claims expire, that
records what it was told (the Redis store itself is tested in
test_redis_routing.py). The last part checks the Lua scripts' named arguments
and replies without a Redis server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re

import pytest

from gym_sessions.errors import ClaimsUnavailableError, SessionConflictError
from gym_sessions.routing.claim_store import LocalClaimStore
from gym_sessions.routing.owned_claims import (
    EXPIRY_MARGIN_SECONDS,
    TRANSITIONS,
    ClaimEvent,
    ClaimState,
    OwnedClaims,
    StoreExpiry,
)
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.routing.redis_connection import connect_redis
from gym_sessions.routing.redis_registry import (
    HEARTBEAT_SECONDS,
    REGISTRATION_SECONDS,
    EntrySigner,
    WorkerRegistry,
)
from gym_sessions.routing.redis_scripts import (
    SCRIPTS,
    ClaimFree,
    ClaimHeld,
    ClaimLost,
    ClaimSettling,
    CreateArgs,
    parse_claim_reply,
)

from .fake_clock import FakeClock

WINDOW = 30.0
ME = "w-me"
S = ClaimState
E = ClaimEvent
HELD_STATES = [S.CLAIMED, S.OPEN, S.RECORD, S.CLOSED, S.RELEASING, S.RESTORING]


class ExpiringStore:
    """A store whose claims expire: answers as told and records every call."""

    expires = True

    def __init__(self) -> None:
        self.calls: list[tuple[object, ...]] = []
        self.holders: dict[str, str] = {}  # what `create` finds: id -> worker id
        self.taken: set[str] = set()  # ids another worker holds now (hold/expire fail)
        self.unreachable = False
        self.gate: asyncio.Event | None = None  # hold/expire wait for it when set

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        self.calls.append(("create", session_id, restoring))
        return self.holders.get(session_id)

    async def read(self, session_id: str) -> str | None:
        return self.holders.get(session_id)

    async def remove(self, session_id: str) -> None:
        self.calls.append(("remove", session_id))

    async def hold(self, session_id: str) -> bool:
        return await self._keep("hold", session_id)

    async def expire(self, session_id: str, seconds: float) -> bool:
        return await self._keep("expire", session_id, seconds)

    async def _keep(self, *call: object) -> bool:
        self.calls.append(call)
        if self.gate is not None:
            await self.gate.wait()
        if self.unreachable:
            raise ClaimsUnavailableError("the test store is unreachable")
        return call[1] not in self.taken


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def owned(store=None, clock=None, **options) -> OwnedClaims:
    return OwnedClaims(
        store or LocalClaimStore(), ME, WINDOW, clock=clock or FakeClock(), **options
    )


async def reach(claims: OwnedClaims, sid: str, state: ClaimState) -> None:
    """Bring ``sid``'s claim to ``state`` by the public calls (RELEASING keeps one request in)."""
    if state is S.RESTORING:  # a takeover (durable sessions), not a claim
        assert await claims.take_over(sid, "w-dead") is None
        assert claims.state(sid) is state
        return
    assert await claims.claim(sid) is None
    if state is S.OPEN:
        claims.mark_open(sid)
    elif state is S.RECORD:
        claims.mark_open(sid, live=False)
    elif state is S.CLOSED:
        claims.mark_not_open(sid)
    elif state is S.RELEASING:
        await claims.enter(sid)
        claims.release_now(sid)
    assert claims.state(sid) is state


def released_ids(claims: OwnedClaims) -> list[str]:
    ids: list[str] = []
    claims.on_release(ids.append)
    return ids


# The table ---------------------------------------------------------------------------


def test_the_table_matches_the_states_own_predicates():
    for state in ClaimState:
        assert state.should_expire == ((state, E.WINDOW_PASSED) in TRANSITIONS), state
        assert state.live == ((state, E.IDLE_TIMEOUT) in TRANSITIONS), state
        assert state.open == (state in (S.OPEN, S.RECORD))
    assert [s for s in ClaimState if s.live] == [S.OPEN]
    assert not any(state is S.ENDED for state, _ in TRANSITIONS)  # final
    for state in HELD_STATES:  # whatever happens, a claim can always be let go of
        for event in (E.RELEASE_NOW, E.TAKEN_ELSEWHERE):
            assert TRANSITIONS[state, event] is S.ENDED


@pytest.mark.parametrize(("state", "event"), list(TRANSITIONS), ids=lambda v: v.name)
async def test_every_defined_transition_goes_where_the_table_says(state, event):
    claims = owned()
    await reach(claims, "s", state)
    claim = claims._claims["s"]
    new = TRANSITIONS[state, event]
    assert claims._transition("s", claim, event)
    assert claim.state is new and claims.state("s") is new
    assert claims.live_sessions == (1 if new.live else 0)
    assert ("s" in claims) == (new is not S.ENDED)


UNDEFINED = [(s, e) for s in HELD_STATES for e in ClaimEvent if (s, e) not in TRANSITIONS]


@pytest.mark.parametrize(("state", "event"), UNDEFINED, ids=lambda v: v.name)
async def test_an_undefined_transition_is_refused_and_logged(state, event, caplog):
    claims = owned()
    await reach(claims, "s", state)
    live = claims.live_sessions
    claim = claims._claims["s"]
    with caplog.at_level(logging.ERROR, logger="gym_sessions.routing"):
        assert not claims._transition("s", claim, event)
    assert claim.state is state and claims.state("s") is state
    assert claims.live_sessions == live and "s" in claims
    assert f"{event.name} is not defined in state {state.name}" in caplog.text


def test_the_undefined_transitions_are_the_ones_no_caller_makes():
    # What is left out on purpose: a window never ends an open claim, only a live
    # session idles out, and only a releasing claim ends with its last request.
    assert sorted((s.name, e.name) for s, e in UNDEFINED) == sorted(
        [(s.name, E.WINDOW_PASSED.name) for s in (S.OPEN, S.RECORD, S.RESTORING)]
        + [(s.name, E.IDLE_TIMEOUT.name) for s in HELD_STATES if s is not S.OPEN]
        + [(s.name, E.LAST_REQUEST_LEFT.name) for s in HELD_STATES if s is not S.RELEASING]
        # Only a restore ends RESTORING: it is synchronous, no request or mark comes in between.
        + [
            (S.RESTORING.name, e.name)
            for e in (E.MARK_OPEN_LIVE, E.MARK_OPEN_RECORD, E.MARK_NOT_OPEN)
        ]
        + [
            (s.name, e.name)
            for s in HELD_STATES
            if s is not S.RESTORING
            for e in (E.RESTORED, E.RESTORE_FAILED)
        ]
    )


async def test_an_ended_claim_refuses_every_event(caplog):
    claims = owned()
    await reach(claims, "s", S.CLAIMED)
    claim = claims._claims["s"]
    claims.release_now("s")
    assert claim.state is S.ENDED and "s" not in claims
    for event in ClaimEvent:
        assert not claims._transition("s", claim, event)
        assert claim.state is S.ENDED
    assert caplog.text.count("is not defined in state ENDED") == len(ClaimEvent)


# OwnedClaims through its public calls --------------------------------------------------


async def test_live_sessions_count_open_claims_only():
    claims = owned()
    for sid in "abc":
        assert await claims.claim(sid) is None
    assert claims.live_sessions == 0 and claims.state("a") is S.CLAIMED
    claims.mark_open("a")
    claims.mark_open("a")  # a restart: still one
    claims.mark_open("b", live=False)
    assert claims.live_sessions == 1 and claims.state("b") is S.RECORD
    claims.mark_open("b")
    claims.mark_open("c")
    assert claims.live_sessions == 3
    claims.mark_not_open("a")
    claims.release_now("b")
    assert claims.live_sessions == 1
    assert [claims.state(s) for s in "abc"] == [S.CLOSED, S.ENDED, S.OPEN]


async def test_a_record_kept_for_an_open_session_is_no_longer_live():
    # An agent's close keeps a receipt: its room is free at once, not a window later.
    claims = owned(max_sessions=1)
    await reach(claims, "s", S.OPEN)
    assert claims.reserve_room("t") is None
    claims.mark_open("s", live=False)
    assert claims.state("s") is S.RECORD and claims.live_sessions == 0
    assert claims.reserve_room("t") is not None


async def test_room_is_reserved_by_starts_and_handed_to_the_session_when_it_opens():
    claims = owned(max_sessions=1)
    first = claims.reserve_room("a")
    assert first is not None and first.active
    assert claims.reserve_room("b") is None  # taken by a's start
    await claims.claim("a")
    claims.mark_open("a")
    assert not first.active and claims.live_sessions == 1
    assert claims.reserve_room("b") is None  # taken by a's session now
    restart = claims.reserve_room("a")  # a restart of a live session needs no room
    assert restart is not None and not restart.active
    claims.give_back_room(first)  # the start's cleanup: the room is the session's
    assert claims.reserve_room("b") is None
    claims.mark_not_open("a")
    assert claims.reserve_room("b") is not None


async def test_a_start_that_never_opens_gives_its_room_back():
    claims = owned(max_sessions=1)
    reservation = claims.reserve_room("a")
    assert reservation is not None
    await reach(claims, "a", S.CLOSED)
    claims.give_back_room(reservation)
    assert claims.reserve_room("b") is not None


async def test_the_sweep_ends_claims_that_are_not_open_a_window_after_their_last_request(clock):
    claims = owned(clock=clock)
    released = released_ids(claims)
    for sid, state in [("claimed", S.CLAIMED), ("closed", S.CLOSED)]:
        await reach(claims, sid, state)
    await reach(claims, "open", S.OPEN)
    await reach(claims, "record", S.RECORD)
    await reach(claims, "busy", S.CLOSED)
    await claims.enter("busy")
    clock.advance(WINDOW - 0.01)
    assert claims.sweep() == []
    clock.advance(0.01)
    assert sorted(claims.sweep()) == ["claimed", "closed"]
    assert sorted(released) == ["claimed", "closed"]
    assert claims.state("claimed") is S.ENDED
    clock.advance(10 * WINDOW)
    assert claims.sweep() == []  # open, a record, a request in flight: none ends
    await claims.leave("busy")  # its window starts now
    clock.advance(WINDOW - 0.01)
    assert claims.sweep() == []
    clock.advance(0.01)
    assert claims.sweep() == ["busy"]
    assert claims.state("open") is S.OPEN and claims.state("record") is S.RECORD


async def test_a_live_session_idles_out_then_ends_a_window_later(clock):
    claims = owned(clock=clock, idle_timeout=5.0)
    idled = []
    claims.on_idle(idled.append)
    await reach(claims, "idle", S.OPEN)
    await reach(claims, "busy", S.OPEN)
    await reach(claims, "record", S.RECORD)
    await claims.enter("busy")
    clock.advance(5.0)
    assert claims.sweep() == []
    assert idled == ["idle"]
    assert claims.state("idle") is S.CLOSED and claims.live_sessions == 1
    assert claims.state("busy") is S.OPEN and claims.state("record") is S.RECORD
    clock.advance(WINDOW)
    assert claims.sweep() == ["idle"]


async def test_an_idled_out_session_closes_whatever_its_hook_did(clock):
    claims = owned(clock=clock, idle_timeout=5.0)
    # An agent's hook keeps a receipt (a record) for the session it ends.
    claims.on_idle(lambda sid: claims.mark_open(sid, live=False))
    await reach(claims, "s", S.OPEN)
    clock.advance(5.0)
    claims.sweep()
    # The receipt's record stays (its owner drops it); the session is not live.
    assert claims.state("s") is S.RECORD and claims.live_sessions == 0


async def test_an_idle_hook_that_releases_the_claim_ends_it(clock):
    claims = owned(clock=clock, idle_timeout=5.0)
    claims.on_idle(claims.release_now)
    await reach(claims, "s", S.OPEN)
    clock.advance(5.0)
    claims.sweep()
    assert claims.state("s") is S.ENDED and claims.live_sessions == 0


async def test_a_claim_released_while_in_flight_ends_with_its_last_request():
    claims = owned()
    released = released_ids(claims)
    await reach(claims, "s", S.OPEN)
    await claims.enter("s")
    await claims.enter("s")
    claims.release_now("s")
    assert claims.state("s") is S.RELEASING and claims.live_sessions == 0
    assert "s" in claims and not claims.holds("s") and released == []
    claims.mark_not_open("s")  # a close meanwhile does not undo the release
    assert claims.state("s") is S.RELEASING
    await claims.leave("s")
    assert claims.state("s") is S.RELEASING and released == []
    await claims.leave("s")
    assert claims.state("s") is S.ENDED and released == ["s"]


async def test_a_start_that_opens_its_session_cancels_a_pending_release():
    claims = owned()
    await reach(claims, "s", S.RELEASING)
    claims.mark_open("s")
    assert claims.state("s") is S.OPEN and claims.holds("s") and claims.live_sessions == 1
    await claims.leave("s")
    assert claims.state("s") is S.OPEN


async def test_release_now_with_nothing_in_flight_ends_the_claim_at_once():
    claims = owned()
    released = released_ids(claims)
    await reach(claims, "s", S.OPEN)
    claims.release_now("s")
    assert claims.state("s") is S.ENDED and released == ["s"] and claims.live_sessions == 0
    claims.release_now("s")  # nothing held: nothing happens
    assert released == ["s"]


async def test_a_new_claim_of_an_ended_id_starts_over():
    claims = owned()
    await reach(claims, "s", S.OPEN)
    first = claims.incarnation("s")
    claims.release_now("s")
    await reach(claims, "s", S.CLAIMED)
    assert claims.incarnation("s") is not first and claims.live_sessions == 0


# The store side: StoreExpiry -----------------------------------------------------------


def expiry(claims: OwnedClaims, sid: str) -> StoreExpiry:
    return claims._claims[sid].expiry


async def test_a_store_without_expiry_is_never_asked_to_hold_or_expire(clock):
    store = ExpiringStore()
    store.expires = False  # as the file store
    store.holders["s"] = ME  # even an adopted claim: there is no expiry to lift
    claims = owned(store, clock)
    await reach(claims, "s", S.CLAIMED)
    assert expiry(claims, "s") is StoreExpiry.HELD
    await claims.enter("s")
    await claims.leave("s")
    claims.mark_open("s")
    claims.mark_not_open("s")
    clock.advance(WINDOW)
    claims.sweep()
    await claims.wait_for_store()
    assert claims.state("s") is S.ENDED
    assert store.calls == [("create", "s", False), ("remove", "s")]


async def test_the_store_expiry_follows_state_and_requests(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    assert await claims.claim("s") is None
    assert expiry(claims, "s") is StoreExpiry.HELD
    await claims.enter("s")
    await claims.leave("s")  # idle and not open: expires
    assert expiry(claims, "s") is StoreExpiry.EXPIRING
    await claims.enter("s")  # a request in flight: held first
    assert expiry(claims, "s") is StoreExpiry.HELD
    claims.mark_open("s")
    await claims.leave("s")  # open: stays held
    claims.mark_not_open("s")  # outside a request: synced in the background
    await claims.wait_for_store()
    assert expiry(claims, "s") is StoreExpiry.EXPIRING
    claims.release_now("s")
    await claims.wait_for_store()
    seconds = WINDOW + EXPIRY_MARGIN_SECONDS
    assert store.calls == [
        ("create", "s", False),
        ("expire", "s", seconds),
        ("hold", "s"),
        ("expire", "s", seconds),
        ("remove", "s"),
    ]


async def test_an_adopted_claim_is_unknown_and_its_first_request_holds_it(clock):
    store = ExpiringStore()
    store.holders["s"] = ME  # our own claim, left behind by a failed removal
    claims = owned(store, clock)
    assert await claims.claim("s") is None
    assert expiry(claims, "s") is StoreExpiry.UNKNOWN
    await claims.enter("s")
    assert expiry(claims, "s") is StoreExpiry.HELD
    assert store.calls[-1] == ("hold", "s")


async def test_an_unknown_expiry_is_written_even_when_the_state_wants_expiry(clock):
    # The old boolean could not say "unknown": an adopted idle claim counted as
    # expiring, so no sync ever wrote its expiry. UNKNOWN never matches.
    store = ExpiringStore()
    store.holders["s"] = ME
    claims = owned(store, clock)
    assert await claims.claim("s") is None
    claims.sweep()
    await claims.wait_for_store()
    assert store.calls[-1] == ("expire", "s", WINDOW + EXPIRY_MARGIN_SECONDS)
    assert expiry(claims, "s") is StoreExpiry.EXPIRING


async def test_a_restore_writes_every_claim_back_then_syncs_it_to_what_it_needs(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    await reach(claims, "open", S.OPEN)
    await reach(claims, "closed", S.CLOSED)
    await claims.wait_for_store()
    assert (expiry(claims, "open"), expiry(claims, "closed")) == (
        StoreExpiry.HELD,
        StoreExpiry.EXPIRING,
    )
    store.calls.clear()
    assert await claims.restore() == 0
    # Both written back, and each forced once to its expiry, whatever memory said before.
    assert sorted(store.calls) == sorted(
        [
            ("create", "open", True),
            ("create", "closed", True),
            ("hold", "open"),
            ("expire", "closed", WINDOW + EXPIRY_MARGIN_SECONDS),
        ]
    )
    assert (expiry(claims, "open"), expiry(claims, "closed")) == (
        StoreExpiry.HELD,
        StoreExpiry.EXPIRING,
    )


async def test_a_restore_drops_the_claims_another_worker_took_meanwhile(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    released = released_ids(claims)
    await reach(claims, "mine", S.OPEN)
    await reach(claims, "taken", S.OPEN)
    store.holders["taken"] = "w-other"
    assert await claims.restore() == 1
    assert claims.state("taken") is S.ENDED and released == ["taken"]
    assert claims.live_sessions == 1 and claims.state("mine") is S.OPEN
    assert ("remove", "taken") not in store.calls  # the key is the other worker's


async def test_a_claim_the_store_says_was_taken_ends_here_without_removing_the_key(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    released = released_ids(claims)
    await reach(claims, "s", S.CLAIMED)
    await claims.enter("s")
    store.taken.add("s")  # its expiry ran out while this worker stalled; another took it
    await claims.leave("s")
    assert claims.state("s") is S.ENDED and released == ["s"]
    assert ("remove", "s") not in store.calls


async def test_a_request_for_a_claim_taken_elsewhere_is_a_conflict(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    await reach(claims, "s", S.CLAIMED)
    await claims.enter("s")
    await claims.leave("s")
    store.taken.add("s")
    with pytest.raises(SessionConflictError):
        await claims.enter("s")
    assert claims.state("s") is S.ENDED


async def test_a_claim_whose_expiry_cannot_be_lifted_is_not_served(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    await reach(claims, "s", S.CLAIMED)
    await claims.enter("s")
    await claims.leave("s")
    store.unreachable = True
    with pytest.raises(ClaimsUnavailableError):
        await claims.enter("s")
    claim = claims._claims["s"]
    assert claim.in_flight == 0 and claim.state is S.CLAIMED
    assert claim.expiry is StoreExpiry.EXPIRING


async def test_the_store_ends_in_line_with_changes_made_during_a_store_call(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    await reach(claims, "s", S.CLAIMED)
    await claims.enter("s")
    store.gate = asyncio.Event()
    leaving = asyncio.ensure_future(claims.leave("s"))  # wants the expiry ...
    await asyncio.sleep(0)
    assert store.calls[-1][0] == "expire"
    await claims.enter("s")  # ... but a request came in meanwhile
    store.gate.set()
    await leaving
    assert store.calls[-2:] == [("expire", "s", WINDOW + EXPIRY_MARGIN_SECONDS), ("hold", "s")]
    assert expiry(claims, "s") is StoreExpiry.HELD


async def test_a_releasing_claim_whose_last_request_was_refused_ends_a_window_later(clock):
    store = ExpiringStore()
    claims = owned(store, clock)
    await reach(claims, "s", S.CLAIMED)
    await claims.enter("s")
    await claims.leave("s")  # expiring
    store.gate = asyncio.Event()
    entering = asyncio.ensure_future(claims.enter("s"))
    await asyncio.sleep(0)
    assert store.calls[-1] == ("hold", "s")  # the request waits on the store ...
    claims.release_now("s")  # ... while a handler lets the claim go
    assert claims.state("s") is S.RELEASING
    store.unreachable = True
    store.gate.set()
    with pytest.raises(ClaimsUnavailableError):
        await entering
    # No `leave` will come: nothing in flight, still releasing.
    assert claims.state("s") is S.RELEASING and claims._claims["s"].in_flight == 0
    clock.advance(WINDOW)
    assert claims.sweep() == ["s"]
    await claims.wait_for_store()
    assert store.calls[-1] == ("remove", "s")


# Redis: script arguments, replies, timing ----------------------------------------------


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_binds_every_argument_by_name_and_counts_no_positions(script):
    args_class, text = SCRIPTS[script]
    names = [f.name for f in dataclasses.fields(args_class)]
    header = args_class.lua_locals()
    assert text.startswith(header)
    expected = [
        *(f"local {n} = KEYS[{i}]" for i, n in enumerate(names[: args_class.key_count], 1)),
        *(f"local {n} = ARGV[{i}]" for i, n in enumerate(names[args_class.key_count :], 1)),
    ]
    assert header.splitlines() == expected
    body = text[len(header) :]
    assert "KEYS[" not in body and "ARGV[" not in body
    for name in names:
        assert re.search(rf"\b{name}\b", body), f"{script}: {name} is never used"


def test_script_arguments_go_to_redis_as_keys_then_args_in_field_order():
    args = CreateArgs(
        claim_key="k",
        index_key="i",
        indexed_workers_key="iw",
        claim_value="v",
        claim_name="n",
        registration_prefix="rp",
        orphan_ms=40000,
        epoch_key="e",
        grace_ms=6000,
        restoring=True,
        worker_id="w",
        index_prefix="ip",
    )
    assert args.call() == {
        "keys": ["k", "i", "iw"],
        "args": ["v", "n", "rp", 40000, "e", 6000, "1", "w", "ip"],
    }
    assert dataclasses.replace(args, restoring=False).call()["args"][6] == "0"


def test_every_claim_reply_shape_has_one_type():
    assert parse_claim_reply(None) == ClaimFree()
    assert parse_claim_reply(["w|a|m"]) == ClaimHeld("w|a|m", None)
    assert parse_claim_reply(["w|a|m", "a|m2"]) == ClaimHeld("w|a|m", "a|m2")
    assert parse_claim_reply(["", "has lost its data"]) == ClaimSettling("has lost its data")
    assert parse_claim_reply(["", "lost", "w2", "a|m2"]) == ClaimLost("w2", "a|m2")
    assert parse_claim_reply(["", "lost", "w2", None]) == ClaimLost("w2", None)
    assert parse_claim_reply(["", "lost", "w2"]) == ClaimLost("w2", None)


async def test_memory_is_trusted_until_a_takeover_could_have_happened(clock):
    # No connection is made: building a client and scripts does not connect.
    client = connect_redis("redis://127.0.0.1:9")
    try:
        registry = WorkerRegistry(client, ME, EntrySigner("secret"), clock=clock)
        store = RedisClaimStore(client, registry, WINDOW + EXPIRY_MARGIN_SECONDS)
        trusted = store.trusted_for()
        assert trusted == REGISTRATION_SECONDS + WINDOW + EXPIRY_MARGIN_SECONDS - HEARTBEAT_SECONDS
        assert trusted == WINDOW + 18.0  # as docs/design.md 3.9.4 works it out
        assert not store.standing()  # never registered
        registry.last_registered = clock()
        clock.advance(trusted - 0.01)
        assert store.standing()
        clock.advance(0.01)
        assert not store.standing()
    finally:
        await client.aclose()
