"""Agent sessions routed across in-process workers: every agent route and lifetime row."""

from __future__ import annotations

import asyncio
import socket

import pytest

from .cluster import Cluster, new_id, wait_until
from .fake_clock import FakeClock
from .probe_agent import ProbeAgent

WINDOW = 1.0
# For tests that wait for the agent's own records (receipts, failed seeds) to
# end: the agent keeps them on the real clock, so their windows pass in real time.
SHORT_WINDOW = 0.25
COOKIE = "gym_session"


@pytest.fixture
def agents(start_clusters):
    """Workers whose claim windows pass only when the test says so (`Cluster.elapse`)."""

    async def make(n: int = 3, **kw) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", WINDOW)
        kw.setdefault("clock", FakeClock())
        return await start_clusters(ProbeAgent, n, **kw)

    return make


async def seed(worker, sid, **flags):
    return await worker.request("POST", "/v1/agent_sessions", {"agent_session_id": sid, **flags})


async def test_agent_session_routes_by_body_and_cookie_to_its_seeder(agents):
    c = await agents(3)
    sid = new_id()
    seeded = await seed(c[1], sid)
    assert seeded.status == 200 and seeded.json == {"agent_session_id": sid, "created": True}
    assert c.claim_owner(sid) == c[1].id
    assert c.credentials.decode_cookie(seeded.cookie)["agent_session_id"] == sid
    for i in range(6):
        bumped = await c[i % 3].request("POST", "/bump", cookie=seeded.cookie)
        assert bumped.json == {"worker": c[1].id, "n": i + 1}
    closed = await c[2].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.json == {"agent_session_id": sid, "outcome": "closed", "n": 6, "worker": c[1].id}
    # A retried close, through any worker, gets the same receipt.
    again = await c[0].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert again.json == closed.json
    assert c[1].server.closed_states == [sid]
    # The receipt is dropped a window after it was written, and the claim with it.
    assert c.claim_owner(sid) == c[1].id
    assert await wait_until(lambda: c.claim_owner(sid) is None, WINDOW * 6)
    assert c[1].server.metrics()["receipts"] == 0


async def test_open_agent_session_keeps_its_claim(agents):
    c = await agents(2)
    sid = new_id()
    await seed(c[0], sid)
    await c.elapse(WINDOW * 1.5)
    assert c.claim_owner(sid) == c[0].id


async def test_seed_that_creates_nothing_releases_its_claim_at_once(agents):
    c = await agents(2)
    sid = new_id()
    reply = await seed(c[1], sid, nothing=True)
    assert reply.json == {"agent_session_id": sid, "created": False}
    assert c.claim_owner(sid) is None


async def test_state_that_cannot_be_registered_is_released_with_the_close_hook(agents):
    c = await agents(2)
    sid = new_id()
    reply = await seed(c[0], sid, refuse=True)
    assert reply.status == 500
    assert "could not be registered" in reply.json["error"]["message"]
    assert c[0].server.closed_states == [sid]
    assert c.claim_owner(sid) is None


async def test_failed_seed_is_kept_for_the_callers_close(agents):
    c = await agents(3)
    sid = new_id()
    c[0].server.close_failures = 1
    reply = await seed(c[0], sid, refuse=True, close_fails=True)
    assert reply.status == 500
    assert c[0].server.metrics()["failed_seeds"] == 1
    assert c.claim_owner(sid) == c[0].id
    closed = await c[2].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.json["outcome"] == "closed"
    assert closed.json["worker"] == c[0].id
    assert c[0].server.closed_states == [sid]
    assert c[0].server.metrics()["failed_seeds"] == 0


async def test_failed_seed_nobody_closes_is_dropped_in_the_background(agents):
    c = await agents(2, session_close_retry_window_seconds=SHORT_WINDOW)
    sid = new_id()
    c[0].server.close_failures = 2  # the rollback fails, then the first background drop too
    await seed(c[0], sid, refuse=True, close_fails=True)
    assert c[0].server.metrics()["failed_seeds"] == 1
    # A window later the background tries to drop it; checked at once (no await
    # between), long before the retry a window after that.
    assert await wait_until(lambda: c[0].server.close_failures == 0, SHORT_WINDOW * 20)
    # The first background drop raised: the record is kept and retried a window later.
    assert c[0].server.metrics()["failed_seeds"] == 1
    assert c.claim_owner(sid) == c[0].id
    assert await wait_until(lambda: c.claim_owner(sid) is None, SHORT_WINDOW * 20)
    assert c[0].server.closed_states == [sid]
    assert c[0].server.metrics()["failed_seeds"] == 0


@pytest.mark.parametrize("n", [1, 3])
async def test_seed_whose_cookie_names_another_session_gets_409(agents, n):
    c = await agents(n)
    first = await seed(c[0], new_id())
    reply = await c[n - 1].request(
        "POST", "/v1/agent_sessions", {"agent_session_id": new_id()}, cookie=first.cookie
    )
    assert reply.status == 409
    assert reply.json["error"]["code"] == "session_conflict"


async def test_closed_agent_session_cannot_be_seeded_again_within_the_window(agents):
    c = await agents(2)
    sid = new_id()
    await seed(c[0], sid)
    await c[1].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    again = await seed(c[1], sid)
    assert again.status == 409
    assert again.json["error"]["code"] == "session_closed"


async def test_agent_requests_without_a_session_leave_no_claim(agents):
    c = await agents(2)
    for method, path in (("GET", "/health"), ("POST", "/bump")):
        reply = await c[1].request(method, path)
        assert reply.set_cookies == []
    assert c.claim_count() == 0


async def test_agent_session_of_an_exited_worker_gets_410(agents):
    c = await agents(3)
    sid = new_id()
    seeded = await seed(c[1], sid)
    path = c.runtime_dir.socket_path(c[1].id)
    await c[1].stop_listening()
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(path)  # a killed worker leaves its socket file; connecting is refused
        for reply in (
            await c[0].request("POST", "/bump", cookie=seeded.cookie),
            await c[2].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid}),
            await seed(c[0], sid),
        ):
            assert reply.status == 410
            assert reply.json["error"]["code"] == "session_gone"


async def test_agent_sessions_work_with_one_worker(agents):
    c = await agents(1)
    sid = new_id()
    seeded = await seed(c[0], sid)
    assert (await c[0].request("POST", "/bump", cookie=seeded.cookie)).json["n"] == 1
    closed = await c[0].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.json["n"] == 1


async def test_seed_that_creates_nothing_sets_no_cookie(agents):
    c = await agents(2)
    reply = await seed(c[1], new_id(), nothing=True)
    assert reply.status == 200
    assert reply.set_cookies == []


async def test_concurrent_seeds_of_one_id_create_one_state(agents):
    c = await agents(2)
    sid = new_id()
    for worker in c.workers:
        worker.server.seed_delay = 0.2
    replies = await asyncio.gather(*[seed(c[i % 2], sid) for i in range(4)])
    assert sorted(r.json["created"] for r in replies) == [False, False, False, True]
    assert [s for w in c.workers for s in w.server.seeded] == [sid]
