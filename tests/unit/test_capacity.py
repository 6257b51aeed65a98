"""Session capacity (``max_sessions``) and idle expiry, with in-process workers on real sockets."""

from __future__ import annotations

import asyncio
import random

from .cluster import new_id, seed_start, wait_until
from .probe_agent import ProbeAgent
from .probe_server import ProbeServer


async def test_starts_on_a_full_worker_are_placed_on_workers_with_room(cluster):
    c = await cluster(3, max_sessions=2)
    replies = [await seed_start(c[0]) for _ in range(6)]  # every start lands on worker 0
    assert [r.status for r in replies] == [200] * 6
    assert sorted(c.live_sessions()) == [2, 2, 2]
    # Each placed session lives where its claim says, and its cookie reaches it there.
    for reply in replies:
        sid = reply.json["resources_session_id"]
        assert c.claim_owner(sid) == reply.json["worker"]
        touched = await c[1].request("POST", "/touch", cookie=reply.cookie)
        assert touched.json["worker"] == reply.json["worker"]
    full = await seed_start(c[2])
    assert full.status == 503 and full.json["error"]["code"] == "capacity_reached"
    assert full.headers["retry-after"] == "5" and "x-gym-no-room" not in full.headers
    assert full.set_cookies == []
    # A restart of a live session needs no room; a close frees room for the next start.
    first = replies[0].json["resources_session_id"]
    assert (await c[1].request("POST", "/reset", {"resources_session_id": first})).status == 200
    closed = await c[2].request("POST", "/close_session", {"resources_session_id": first})
    assert closed.json["outcome"] == "closed"
    again = await seed_start(c[1])
    assert again.status == 200 and again.json["worker"] == replies[0].json["worker"]


async def test_a_concurrent_burst_fills_every_worker_exactly(cluster):
    n = 5
    c = await cluster(3, max_sessions=n)
    rng = random.Random(7)
    replies = await asyncio.gather(*[seed_start(c[rng.randrange(3)]) for _ in range(3 * n)])
    assert [r.status for r in replies] == [200] * (3 * n), [r.json for r in replies]
    assert c.live_sessions() == [n, n, n]
    extra = await asyncio.gather(*[seed_start(c[i]) for i in range(3)])
    assert [r.json["error"]["code"] for r in extra] == ["capacity_reached"] * 3
    assert c.live_sessions() == [n, n, n]
    # No room was left taken by the refused starts.
    assert all(w.app.claims._reserved == 0 for w in c.workers)


async def test_failed_starts_give_their_room_back(cluster):
    c = await cluster(2, max_sessions=1)
    failed = await c[0].request(
        "POST", "/seed_session", {"resources_session_id": new_id(), "fail": True}
    )
    assert failed.status == 500
    assert c.live_sessions() == [0, 0]
    assert [r.status for r in [await seed_start(c[0]), await seed_start(c[0])]] == [200, 200]
    assert c.live_sessions() == [1, 1]


async def test_one_full_worker_answers_503(start_clusters):
    c = await start_clusters(ProbeServer, 1, max_sessions=1)
    assert (await seed_start(c[0])).status == 200
    full = await seed_start(c[0])
    assert full.status == 503 and full.json["error"]["code"] == "capacity_reached"


async def test_an_idle_session_expires_and_its_next_request_gets_410(cluster):
    c = await cluster(2, session_idle_timeout=0.3, session_close_retry_window_seconds=5)
    idle = await seed_start(c[0])
    busy = await seed_start(c[0])
    sid = idle.json["resources_session_id"]
    # The busy session keeps getting requests; the idle one none.
    for _ in range(8):
        await c[1].request("POST", "/touch", cookie=busy.cookie)
        await asyncio.sleep(0.1)
    assert await wait_until(lambda: c[0].server.expired_total == 1, within=5)
    assert c[0].server.released == [sid]  # released once, like a close
    for worker in c.workers:
        token = {"X-Gym-Session-Token": idle.json["mcp"]["headers"]["X-Gym-Session-Token"]}
        reply = await worker.request("POST", "/mcp", _count(), headers=token)
        assert reply.status == 410 and reply.json["error"]["data"]["code"] == "session_expired"
        start = await worker.request("POST", "/reset", {"resources_session_id": sid})
        assert start.status == 410 and start.json["error"]["code"] == "session_expired"
    health = await c[0].request("GET", "/health", cookie=busy.cookie)
    assert health.json["expired_sessions"] == 1 and health.json["open_sessions"] == 1
    assert (await c[1].request("POST", "/touch", cookie=busy.cookie)).status == 200
    closed = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "already_closed"
    assert c[0].server.released == [sid]  # the expired session is not released twice


async def test_an_idle_agent_session_expires(cluster):
    c = await cluster(2, server=ProbeAgent, session_idle_timeout=0.3)
    sid = new_id()
    seeded = await c[0].request("POST", "/v1/agent_sessions", {"agent_session_id": sid})
    assert seeded.status == 200
    assert await wait_until(lambda: c[0].server.expired_total == 1, within=5)
    assert await wait_until(lambda: c[0].server.closed_states == [sid], within=5)
    bumped = await c[1].request("POST", "/bump", cookie=seeded.cookie)
    assert bumped.status == 410 and bumped.json["error"]["code"] == "session_expired"
    closed = await c[1].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.json == {"agent_session_id": sid, "outcome": "expired"}
    assert c[0].app.claims.live_sessions == 0


def _count() -> dict:
    return {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "count"}}


async def test_a_full_holders_no_room_mark_never_reaches_the_client(cluster):
    # A failed start leaves worker 1 holding the id (not live); worker 1 then fills up.
    c = await cluster(2, max_sessions=1, session_close_retry_window_seconds=30)
    sid = new_id()
    failed = await c[1].request(
        "POST", "/seed_session", {"resources_session_id": sid, "fail": True}
    )
    assert failed.status != 200 and c.claim_owner(sid) == c[1].id
    assert (await seed_start(c[1])).status == 200
    assert c[1].app.claims.live_sessions == 1
    # Worker 0 forwards the retried start to the id's holder, which has no room.
    retried = await seed_start(c[0], sid)
    assert retried.status == 503 and retried.json["error"]["code"] == "capacity_reached"
    assert "x-gym-no-room" not in retried.headers
