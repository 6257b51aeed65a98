"""Durable sessions (docs/design.md §3.14) with in-process workers sharing a real runtime directory.

Workers get ids naming real stand-in processes (`stand_in_process`), so once
one is killed (`Worker.kill`: its private socket refuses, its memory stays
unreachable, its stand-in is killed) the others can tell it is gone, as with a
SIGKILLed process, and until then it is alive to them. The
takeover race itself runs in real processes racing on one claim file.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import pytest

from envs.counter import CounterEnv
from envs.counter_agent import CounterAgent
from gym_sessions.cli import _report_durability
from gym_sessions.routing.claim_store import FileClaimStore, LocalClaimStore
from gym_sessions.routing.incarnations import Incarnation
from gym_sessions.routing.keys import INDEX_PREFIX, REGISTRATION_PREFIX, snapshot_key
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.routing.session_snapshots import SessionSnapshots
from gym_sessions.routing.snapshot_store import FileSnapshotStore, Snapshot, SnapshotCodec
from gym_sessions.runtime_dir import RuntimeDirectory
from gym_sessions.server.env_server import GymEnvServer, env_capture_method

from .cluster import SECRET, Cluster, dead_worker_id, new_id, redis_backend, wait_until

WINDOW = 5.0


def counter_server() -> GymEnvServer:
    return GymEnvServer(CounterEnv, name="counter")


def cartpole_server() -> GymEnvServer:
    return GymEnvServer(functools.partial(gym.make, "CartPole-v1"), name="cartpole")


class LockedCounter(CounterEnv):
    """A counter holding a lock: pickle refuses it and it has no get_state, so it is not durable."""

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode)
        self.lock = threading.Lock()


class StatefulCounter(CounterEnv):
    """A counter that captures itself with ``get_state`` / ``set_state`` instead of pickle."""

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode)
        self.lock = threading.Lock()  # would defeat pickle: get_state must be what is used

    def get_state(self) -> bytes:
        return f"{self.count},{self.expected_count}".encode()

    def set_state(self, state: bytes) -> None:
        count, expected = state.decode().split(",")
        self.count = int(count)
        self.expected_count = None if expected == "None" else int(expected)


@pytest.fixture
def durable(start_clusters):
    async def make(make_server: Any = counter_server, n: int = 3, **kw: Any) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", WINDOW)
        kw.setdefault("durable_sessions", True)
        return await start_clusters(make_server, n, stand_ins=True, **kw)

    return make


async def start_counter(c: Cluster, index: int, sid: str, initial: int = 5, expected: int = 8):
    options = {"initial_count": initial, "expected_count": expected}
    reply = await c[index].request(
        "POST", "/reset", {"resources_session_id": sid, "options": options}
    )
    assert reply.status == 200, reply.json
    return reply.cookie


def restored_total(c: Cluster) -> int:
    return sum(w.app.snapshots.restored_total for w in c.workers if w.app.snapshots)


async def test_a_dead_holders_session_continues_on_the_worker_that_gets_its_next_request(durable):
    c = await durable()
    sid = new_id()
    start = await c[0].request(
        "POST",
        "/reset",
        {"resources_session_id": sid, "options": {"initial_count": 5, "expected_count": 8}},
    )
    cookie, token = start.cookie, start.json["mcp"]["headers"]["X-Gym-Session-Token"]
    for action in (1, 1):
        step = await c[0].request("POST", "/step", {"action": action}, cookie=cookie)
        assert step.status == 200
    assert step.json["observation"] == 7
    assert c.runtime_dir is not None and c.runtime_dir.snapshot_count() == 1
    await c[0].kill()
    # The client's cookie of the first incarnation keeps working: no error, same count.
    step = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert step.status == 200, step.json
    assert step.json["observation"] == 8
    assert c.claim_owner(sid) == c[1].id
    # Other workers now forward to the new holder; the old incarnation's proof still holds.
    observe = await c[2].request("POST", "/observe", {}, cookie=cookie)
    assert observe.status == 200 and observe.json == {"observation": 8, "episode_length": 3}
    # So does the session's MCP token (it carries the same incarnation).
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "observe", "arguments": {}},
    }
    mcp = await c[2].request("POST", "/mcp", call, headers={"X-Gym-Session-Token": token})
    assert mcp.status == 200 and mcp.json["result"]["structuredContent"]["observation"] == 8
    verify = await c[2].request("POST", "/verify", cookie=cookie)
    assert verify.status == 200 and verify.json["reward"] == 1.0
    assert restored_total(c) == 1


async def test_a_step_batch_restores_a_dead_holders_sessions_as_their_steps_would(durable):
    # Each entry follows its own /step's rule: a holder that refused the hop
    # and has exited is taken over, the session restored where the batch landed.
    c = await durable()
    on_dead = [new_id() for _ in range(3)]
    cookies = {sid: await start_counter(c, 0, sid, initial=10 * k) for k, sid in enumerate(on_dead)}
    alive = new_id()
    cookies[alive] = await start_counter(c, 2, alive, initial=100)
    entries = [{"cookie": cookie, "action": 1} for cookie in cookies.values()]
    first = await c[1].request("POST", "/step_batch", {"entries": entries})
    assert first.status == 200
    assert [r["observation"] for r in first.json["results"]] == [1, 11, 21, 101]
    await c[0].kill()
    second = await c[1].request("POST", "/step_batch", {"entries": entries})
    assert second.status == 200
    results = second.json["results"]
    assert [r.get("observation") for r in results] == [2, 12, 22, 102], results
    assert [r["worker"] for r in results] == [c[1].id] * 3 + [c[2].id]
    assert [c.claim_owner(sid) for sid in on_dead] == [c[1].id] * 3
    assert restored_total(c) == 3
    # Restored once: later batches from anywhere reach the new holder.
    third = await c[2].request("POST", "/step_batch", {"entries": entries})
    assert [r.get("observation") for r in third.json["results"]] == [3, 13, 23, 103]
    assert restored_total(c) == 3


async def test_a_step_batch_entry_without_a_snapshot_still_gets_410(durable):
    c = await durable(lambda: GymEnvServer(LockedCounter, name="locked"))
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await c[0].kill()
    reply = await c[1].request(
        "POST", "/step_batch", {"entries": [{"cookie": cookie, "action": 1}]}
    )
    assert reply.status == 200
    (result,) = reply.json["results"]
    assert result["status"] == 410 and result["error"]["code"] == "session_gone"
    assert restored_total(c) == 0


async def test_an_id_alone_never_reaches_a_restored_session(durable):
    c = await durable()
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await c[0].kill()
    # The attacker knows the id: a typed start with another key is refused (the
    # restore keeps the session's bound key), and so is a forged-looking cookie.
    attack = await c[1].request(
        "POST", "/reset", {"resources_session_id": sid, "session_key": "x" * 24}
    )
    assert attack.status == 409, attack.json
    stranger = await c[2].request("POST", "/step", {"action": 3}, cookie=c.cookie_for(sid))
    assert stranger.status == 409, stranger.json
    # The owner's cookie reaches it, untouched by those attempts.
    observe = await c[2].request("POST", "/observe", {}, cookie=cookie)
    assert observe.status == 200 and observe.json["observation"] == 5
    # And the owner's session_key restarts it (typed start, no cookie).
    restart = await c[2].request("POST", "/reset", {"resources_session_id": sid})
    assert restart.status == 200, restart.json


async def test_many_workers_racing_to_restore_one_session_leave_exactly_one_env(durable):
    c = await durable(n=6)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await c[0].kill()
    replies = await _gather(
        [w.request("POST", "/observe", {}, cookie=cookie) for w in c.workers[1:] for _ in range(3)]
    )
    assert [r.status for r in replies] == [200] * 15
    assert {r.json["observation"] for r in replies} == {5}
    assert restored_total(c) == 1
    holders = [w for w in c.workers[1:] if sid in w.server._sessions]
    assert [w.id for w in holders] == [c.claim_owner(sid)]


async def _gather(coroutines):
    import asyncio

    return await asyncio.gather(*coroutines)


def _race(claims_dir: str, sid: str, dead: str, barrier: Any, results: Any) -> None:
    store = FileClaimStore(claims_dir, f"taker-{os.getpid()}")
    barrier.wait()
    outcome = store.take_over_now(sid, dead)
    results.put((store.worker_id, outcome))


def test_of_processes_racing_to_take_over_one_claim_exactly_one_wins(short_tmp):
    # Real processes, released together by a barrier, on one claim file: the
    # O_EXCL lock and the compare under it admit one taker per dead holder.
    context = multiprocessing.get_context("fork")
    runtime = RuntimeDirectory.create(short_tmp)
    dead = dead_worker_id()
    for round_ in range(20):
        sid = f"race-{round_}"
        assert FileClaimStore(runtime.claims_dir, dead).create_now(sid) is None
        barrier = context.Barrier(8)
        results = context.Queue()
        takers = [
            context.Process(target=_race, args=(runtime.claims_dir, sid, dead, barrier, results))
            for _ in range(8)
        ]
        for taker in takers:
            taker.start()
        outcomes = [results.get(timeout=30) for _ in takers]
        for taker in takers:
            taker.join(timeout=30)
        winners = [worker for worker, outcome in outcomes if outcome is None]
        assert len(winners) == 1, outcomes
        holder = FileClaimStore(runtime.claims_dir, "reader").read_now(sid)
        assert holder == winners[0]
        # Losers saw the lock held (the dead holder) or the winner: never themselves.
        assert all(outcome in (dead, holder) for _, outcome in outcomes if outcome is not None)
    assert not [name for name in os.listdir(runtime.claims_dir) if name.startswith(".")]


async def test_a_forged_snapshot_is_never_loaded(durable, caplog):
    c = await durable()
    assert c.runtime_dir is not None
    snapshots = FileSnapshotStore(c.runtime_dir.snapshots_dir)
    forged_sid, moved_sid, other_secret_sid = new_id(), new_id(), new_id()
    cookies = {
        sid: await start_counter(c, 0, sid) for sid in (forged_sid, moved_sid, other_secret_sid)
    }
    # Garbage in place of a snapshot; another session's genuine snapshot moved
    # over this one's; a well-formed snapshot signed with another secret.
    with open(snapshots.paths(forged_sid)[0], "r+b") as file:
        data = bytearray(file.read())
        data[-1] ^= 1
        file.seek(0)
        file.write(data)
    donor = new_id()
    await start_counter(c, 0, donor, initial=40)
    os.replace(snapshots.paths(donor)[0], snapshots.paths(moved_sid)[0])
    alien = SnapshotCodec("another-secret-" + "y" * 20).encode(
        other_secret_sid, Snapshot(Incarnation(bound=True), b"not even a pickle")
    )
    snapshots.remove(other_secret_sid)
    snapshots.save_now(other_secret_sid, alien, 0)
    await c[0].kill()
    with caplog.at_level(logging.ERROR, logger="gym_sessions.routing"):
        for sid, cookie in cookies.items():
            reply = await c[1].request("POST", "/observe", {}, cookie=cookie)
            assert reply.status == 410 and reply.json["error"]["code"] == "session_gone"
            assert c.claim_owner(sid) == c[0].id  # nothing was taken over
    assert caplog.text.count("is signed with this server's secret") == 3
    assert restored_total(c) == 0
    # A genuine snapshot is signed for its session and this server's secret only.
    codec = SnapshotCodec(SECRET)
    blob = codec.encode("a", Snapshot(Incarnation(), b"x"))
    assert codec.decode("a", blob) is not None and codec.decode("b", blob) is None


async def test_an_oversized_snapshot_is_not_kept_and_its_session_gets_410(durable, caplog):
    c = await durable(max_snapshot_bytes=64)
    sid = new_id()
    with caplog.at_level(logging.WARNING, logger="gym_sessions.routing"):
        cookie = await start_counter(c, 0, sid)
        for _ in range(3):
            assert (await c[0].request("POST", "/step", {"action": 1}, cookie=cookie)).status == 200
    assert caplog.text.count("exceeds --max-snapshot-bytes") == 1  # once per session
    assert c.runtime_dir is not None and c.runtime_dir.snapshot_count() == 0
    await c[0].kill()
    reply = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert reply.status == 410


async def test_an_env_that_cannot_be_captured_gets_410_as_without_durability(durable, caplog):
    c = await durable(functools.partial(GymEnvServer, LockedCounter))
    assert c[0].server.durability() is None
    assert env_capture_method(LockedCounter()) is None
    # One line at start-up says so (the supervisor's), none per session.
    with caplog.at_level(logging.WARNING):
        _report_durability(c[0].server, c.settings)
    assert "sessions cannot be captured" in caplog.text
    caplog.clear()
    sid = new_id()
    with caplog.at_level(logging.WARNING, logger="gym_sessions.routing"):
        cookie = await start_counter(c, 0, sid)
        assert (await c[0].request("POST", "/step", {"action": 1}, cookie=cookie)).status == 200
    assert "durable" not in caplog.text
    assert c.runtime_dir is not None and c.runtime_dir.snapshot_count() == 0
    await c[0].kill()
    reply = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert reply.status == 410 and c.claim_owner(sid) == c[0].id


async def test_an_env_with_get_state_is_captured_by_it(durable):
    c = await durable(functools.partial(GymEnvServer, StatefulCounter))
    assert env_capture_method(StatefulCounter()) == "get_state"
    sid = new_id()
    options = {"initial_count": 2, "expected_count": 5}
    start = await c[0].request(
        "POST", "/reset", {"resources_session_id": sid, "seed": 3, "options": options}
    )
    cookie = start.cookie
    assert (await c[0].request("POST", "/step", {"action": 2}, cookie=cookie)).status == 200
    # The seeded generator as of the last reply (the killed worker's memory keeps it).
    rng_state = c[0].server._sessions[sid].env.np_random.bit_generator.state
    await c[0].kill()
    step = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert step.status == 200 and step.json["observation"] == 5
    # A set_state env gets its np_random back from the server (get_state need not).
    restored_env = c[1].server._sessions[sid].env
    assert restored_env.np_random_seed == 3
    assert restored_env.np_random.bit_generator.state == rng_state
    verify = await c[1].request("POST", "/verify", cookie=cookie)
    assert verify.json["reward"] == 1.0 and verify.json["episode_length"] == 2


async def test_snapshots_end_with_their_sessions_and_claims(durable):
    c = await durable()
    assert c.runtime_dir is not None
    closed, verified, idle = new_id(), new_id(), new_id()
    cookies = {sid: await start_counter(c, 1, sid) for sid in (closed, verified, idle)}
    assert c.runtime_dir.snapshot_count() == 3
    close = await c[0].request("POST", "/close_session", {"resources_session_id": closed})
    assert close.status == 200 and close.json["outcome"] == "closed"
    assert (await c[2].request("POST", "/verify", cookie=cookies[verified])).status == 200
    # Closed and verified: their snapshots went with their state, before the reply.
    assert c.runtime_dir.snapshot_count() == 1
    # The claim's end removes the snapshot too (the store removes both).
    c[1].app.claims.release_now(idle)
    await c[1].app.claims.wait_for_store()
    assert c.runtime_dir.snapshot_count() == 0
    assert c.claim_owner(idle) is None


async def test_a_seeded_cartpole_episode_restored_midway_matches_an_uninterrupted_one(durable):
    c = await durable(cartpole_server)

    async def episode(sid: str, kill_after: int | None) -> list[Any]:
        start = await c[0].request("POST", "/reset", {"resources_session_id": sid, "seed": 7})
        cookie, observations = start.cookie, [start.json["observation"]]
        for index in range(30):
            if index == kill_after:
                await c[0].kill()
            worker = c[1] if kill_after is not None and index >= kill_after else c[0]
            step = await worker.request("POST", "/step", {"action": index % 2}, cookie=cookie)
            assert step.status == 200, step.json
            observations.append(step.json["observation"])
            if step.json["terminated"] or step.json["truncated"]:
                break
        # The env's RNG came along: an unseeded reset draws the same start.
        again = await worker.request("POST", "/reset", {"resources_session_id": sid})
        observations.append(again.json["observation"])
        return observations

    uninterrupted = await episode(new_id(), None)
    restored = await episode(new_id(), 4)
    assert len(uninterrupted) > 6  # the kill came mid-episode
    assert restored == uninterrupted
    assert restored_total(c) == 1


# Redis claims (several hosts) ---------------------------------------------------------------


@pytest.fixture
def durable_hosts(start_clusters, redis_server):
    async def make(n: int = 3, **kw: Any) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", WINDOW)
        return await start_clusters(
            counter_server, n, claims=redis_server.url, durable_sessions=True, **kw
        )

    return make


async def crash(worker: Any) -> None:
    """What SIGKILL leaves behind: no listener (its port refuses), no heartbeat."""
    for task in worker.app._background:
        task.cancel()
    assert worker.app._listener is not None
    await worker.app._listener.stop()
    if worker.app.handoff_listener is not None:
        await worker.app.handoff_listener.stop()


def registration_key(worker: Any) -> str:
    return REGISTRATION_PREFIX + worker.id


async def test_redis_a_dead_hosts_session_continues_on_another_host(durable_hosts):
    c = await durable_hosts()
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    assert (await c[0].request("POST", "/step", {"action": 2}, cookie=cookie)).status == 200
    assert c.redis().exists(snapshot_key(sid))
    await crash(c[0])
    # Its registration lapses a few moments later (here: half a second); the
    # request waits for that rather than answer 410.
    c.redis().pexpire(registration_key(c[0]), 500)
    step = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert step.status == 200, step.json
    assert step.json["observation"] == 8
    assert c.claim_owner(sid) == c[1].id
    assert c.redis().pttl(RedisClaimStore.key(sid)) == -1  # held: no expiry
    # The dead worker's index no longer lists it: nothing will write it back for it.
    name = RedisClaimStore.key(sid).rpartition(":")[2]
    assert not c.redis().sismember(INDEX_PREFIX + c[0].id, name)
    verify = await c[2].request("POST", "/verify", cookie=cookie)
    assert verify.status == 200 and verify.json["reward"] == 1.0


async def test_redis_a_worker_that_still_listens_is_never_taken_over(durable_hosts):
    c = await durable_hosts(2)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    for task in c[0].app._background:  # its heartbeat stalls; it still serves
        task.cancel()
    c.redis().delete(registration_key(c[0]))
    slow = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert slow.status == 503  # slow, not gone
    assert c.claim_owner(sid) == c[0].id
    assert sid in c[0].server._sessions and sid not in c[1].server._sessions


async def test_redis_racing_workers_take_a_session_over_once(durable_hosts):
    c = await durable_hosts(6)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    replies = await _gather(
        [w.request("POST", "/observe", {}, cookie=cookie) for w in c.workers[1:] for _ in range(3)]
    )
    assert [r.status for r in replies] == [200] * 15, "; ".join(
        f"{r.status} {r.json}" for r in replies if r.status != 200
    )
    assert restored_total(c) == 1
    holders = [w.id for w in c.workers[1:] if sid in w.server._sessions]
    assert holders == [c.claim_owner(sid)]


async def test_a_request_forwarded_to_the_winner_mid_takeover_waits_for_its_restore(
    durable_hosts,
):
    # The winner's claim is in Redis the moment its takeover script ran, so a
    # losing worker forwards there at once, maybe before the winner's own
    # memory knows of the takeover. The forwarded request must wait for the
    # restore, not adopt the claim as a fresh one (409, or an empty session).
    # The window is widened here: the winner's takeover reply is delayed.
    c = await durable_hosts(3)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    store = c[1].app.claims.store
    real_take_over = store.take_over
    taken = asyncio.Event()

    async def slow_take_over(session_id: str, dead_holder: str) -> str | None:
        other = await real_take_over(session_id, dead_holder)
        taken.set()
        await asyncio.sleep(0.5)  # the winner's memory learns of it late
        return other

    store.take_over = slow_take_over
    winner = asyncio.ensure_future(c[1].request("POST", "/observe", {}, cookie=cookie))
    await asyncio.wait_for(taken.wait(), 10)
    forwarded = await c[2].request("POST", "/observe", {}, cookie=cookie)
    assert (await winner).status == 200
    assert forwarded.status == 200, forwarded.json
    assert forwarded.json == {"observation": 5, "episode_length": 0}
    assert restored_total(c) == 1
    assert c.claim_owner(sid) == c[1].id


async def test_a_lookup_that_meets_its_own_workers_takeover_waits_for_the_restore(
    durable_hosts,
):
    # A request's store read can leave before this worker's takeover of the
    # session begins and come back after the takeover's script ran: it names
    # this worker while memory has no claim yet. The request must wait for the
    # restore (it once was served without the claim: 409, or an empty state).
    c = await durable_hosts(2)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    store = c[1].app.claims.store
    real_read, real_take_over = store.read, store.take_over
    first_read, taken = asyncio.Event(), asyncio.Event()

    async def read(session_id: str) -> str | None:
        if not first_read.is_set():
            first_read.set()
            await asyncio.sleep(0.3)  # the second request's read leaves meanwhile
        else:
            await taken.wait()  # ...and executes after the takeover's script
        return await real_read(session_id)

    async def take_over(session_id: str, dead_holder: str) -> str | None:
        other = await real_take_over(session_id, dead_holder)
        taken.set()
        await asyncio.sleep(0.5)  # this worker's memory learns of it late
        return other

    store.read, store.take_over = read, take_over
    restoring = asyncio.ensure_future(c[1].request("POST", "/observe", {}, cookie=cookie))
    await asyncio.wait_for(first_read.wait(), 10)
    looked_up = await c[1].request("POST", "/observe", {}, cookie=cookie)
    assert (await restoring).status == 200
    assert looked_up.status == 200, looked_up.json
    assert looked_up.json == {"observation": 5, "episode_length": 0}
    assert restored_total(c) == 1


async def test_redis_a_forged_snapshot_is_never_loaded(durable_hosts, caplog):
    c = await durable_hosts(2)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    forged = SnapshotCodec("another-secret-" + "y" * 20).encode(
        sid, Snapshot(Incarnation(bound=True), b"whatever")
    )
    ttl = c.redis().pttl(snapshot_key(sid))
    assert ttl > 0  # a Redis snapshot always expires by itself
    c.redis().set(snapshot_key(sid), base64.b64encode(forged).decode())
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    with caplog.at_level(logging.ERROR, logger="gym_sessions.routing"):
        reply = await c[1].request("POST", "/observe", {}, cookie=cookie)
    assert reply.status == 410
    assert "is signed with this server's secret" in caplog.text
    assert c.claim_owner(sid) == c[0].id


async def test_redis_snapshots_end_with_their_sessions_and_claims(durable_hosts):
    c = await durable_hosts(2)
    closed, released = new_id(), new_id()
    await start_counter(c, 0, closed)
    await start_counter(c, 1, released)
    assert c.redis().exists(snapshot_key(closed), snapshot_key(released)) == 2
    close = await c[1].request("POST", "/close_session", {"resources_session_id": closed})
    assert close.status == 200
    assert await wait_until(lambda: not c.redis().exists(snapshot_key(closed)))
    c[1].app.claims.release_now(released)
    await c[1].app.claims.wait_for_store()
    assert not c.redis().exists(snapshot_key(released))
    assert c.claim_owner(released) is None


async def test_a_snapshot_write_cut_short_leaves_the_one_before(short_tmp):
    # Two slots written in place, alternately: the newest that verifies wins,
    # so a write the worker died in leaves the last state a client was sent.
    store = FileSnapshotStore(short_tmp)
    codec = SnapshotCodec(SECRET)
    snapshots = SessionSnapshots(
        store,
        OwnedClaims(LocalClaimStore(), "w", WINDOW),
        codec,
        lambda sid: None,
        lambda sid, data: None,
        lambda sid: False,
    )
    incarnation = Incarnation(bound=True)
    for seq, state in enumerate([b"first", b"second", b"third"]):
        store.save_now("s", codec.encode("s", Snapshot(incarnation, state, seq)), seq)
    newest = await snapshots._load("s")
    assert newest is not None and (newest.seq, newest.session) == (2, b"third")
    # Snapshot 3 (slot .1) is cut short mid-record: the length and half the bytes.
    record = codec.encode("s", Snapshot(incarnation, b"fourth" * 20, 3))
    with open(store.paths("s")[1], "r+b") as file:
        file.write(len(record).to_bytes(8, "big") + record[: len(record) // 2])
    survivor = await snapshots._load("s")
    assert survivor is not None and (survivor.seq, survivor.session) == (2, b"third")


@pytest.fixture
def worker_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing for a worker's: runs until the test ends it (killed at teardown)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process
    process.kill()
    process.wait()


async def test_a_worker_that_stopped_listening_is_restored_from_once_it_exits(
    start_clusters, worker_process
):
    # A drained or reloaded worker stops listening moments before it exits:
    # its sessions' requests wait for the exit instead of getting 410.
    ids = [f"{worker_process.pid}-{os.urandom(4).hex()}", dead_worker_id(), dead_worker_id()]
    c = await start_clusters(
        counter_server,
        3,
        worker_ids=ids,
        durable_sessions=True,
        session_close_retry_window_seconds=WINDOW,
    )
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    await c[0].kill()

    def exit_now() -> None:
        worker_process.kill()
        worker_process.wait()  # reaped: gone, not a zombie

    # Half a second after the request, whatever the machine's load (a process
    # that exited a second after its start had exited before a slow setup ended).
    asyncio.get_running_loop().call_later(0.5, exit_now)
    started = time.monotonic()
    step = await c[1].request("POST", "/step", {"action": 3}, cookie=cookie)
    assert step.status == 200 and step.json["observation"] == 8
    assert time.monotonic() - started > 0.3  # it waited for the exit


async def test_an_agent_session_whose_state_pickles_continues_after_its_worker_died(durable):
    c = await durable(CounterAgent)
    sid = new_id()
    seed = await c[0].request(
        "POST", "/v1/agent_sessions", {"agent_session_id": sid, "values": [1, 2]}
    )
    assert seed.status == 200 and seed.json["created"]
    remembered = await c[0].request("POST", "/remember", {"value": 3}, cookie=seed.cookie)
    assert remembered.json == {"count": 3, "total": 6}
    await c[0].kill()
    remembered = await c[1].request("POST", "/remember", {"value": 4}, cookie=seed.cookie)
    assert remembered.status == 200 and remembered.json == {"count": 4, "total": 10}
    # The seed's body came along: a retried seed is not created again, another is 409.
    body = {"agent_session_id": sid, "values": [1, 2]}
    retried = await c[1].request("POST", "/v1/agent_sessions", body, cookie=seed.cookie)
    assert retried.status == 200 and retried.json["created"] is False, retried.json
    other = {"agent_session_id": sid, "values": [9]}
    conflict = await c[1].request("POST", "/v1/agent_sessions", other, cookie=seed.cookie)
    assert conflict.status == 409, conflict.json
    closed = await c[2].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.status == 200, closed.json
    assert closed.json["outcome"] == "closed" and closed.json["total"] == 10
    assert c.runtime_dir is not None and c.runtime_dir.snapshot_count() == 0


async def test_redis_a_dead_hosts_orphaned_claims_last_as_long_as_their_snapshots(
    durable_hosts,
):
    # The reaper (or a reader) gives a dead worker's claims an expiry; had it been
    # the window plus a margin (12 s here), a client back after that would find
    # no claim naming the dead holder, so no takeover: a fresh, empty session
    # (404 no_open_episode) while the snapshot still existed.
    c = await durable_hosts(2)
    sid = new_id()
    cookie = await start_counter(c, 0, sid)
    assert (await c[0].request("POST", "/step", {"action": 2}, cookie=cookie)).status == 200
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    assert await redis_backend(c[1]).redis_store.reap_orphans() == 1
    claim_ttl = c.redis().pttl(RedisClaimStore.key(sid))
    assert claim_ttl >= c.redis().pttl(snapshot_key(sid)) > 3600 * 1000
    step = await c[1].request("POST", "/step", {"action": 1}, cookie=cookie)
    assert step.status == 200, step.json
    assert step.json["observation"] == 8
    assert c.claim_owner(sid) == c[1].id
    assert restored_total(c) == 1


async def test_redis_without_durable_sessions_orphaned_claims_expire_after_the_window(
    start_clusters, redis_server
):
    c = await start_clusters(
        counter_server, 2, claims=redis_server.url, session_close_retry_window_seconds=WINDOW
    )
    sid = new_id()
    await start_counter(c, 0, sid)
    await crash(c[0])
    c.redis().delete(registration_key(c[0]))
    assert await redis_backend(c[1]).redis_store.reap_orphans() == 1
    assert 0 < c.redis().pttl(RedisClaimStore.key(sid)) <= (WINDOW + 10) * 1000
