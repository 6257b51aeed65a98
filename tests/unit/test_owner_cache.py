"""The cross-host owner cache: in-process workers as "hosts" sharing one real redis-server.

A worker that forwards on a cached holder marks the hop (`HELD_MARK`); the
worker it names refuses unless it holds the session, and the sender asks Redis
again. These tests move a session away from its cached holder and check that
the old holder never serves it.
"""

from __future__ import annotations

import pytest

from gym_sessions.routing.owner_cache import OwnerCache

from .cluster import Cluster, Worker, count_call, new_id
from .fake_clock import FakeClock
from .probe_server import ProbeServer

WINDOW = 1.0


@pytest.fixture
def hosts(start_clusters, redis_server):
    async def make(n: int = 3) -> Cluster:
        c = await start_clusters(
            ProbeServer,
            n,
            claims=redis_server.url,
            session_close_retry_window_seconds=WINDOW,
            clock=FakeClock(),
        )
        for worker in c.workers:
            # Entries outlive the whole test: only invalidation may end them.
            worker.app.claims.owner_cache = OwnerCache(ttl=3600)
        return c

    return make


async def _start(worker: Worker, sid: str):
    reply = await worker.request("POST", "/seed_session", {"resources_session_id": sid})
    assert reply.status == 200, reply.json
    return reply


async def _move(c: Cluster, sid: str, to: Worker):
    """Close ``sid`` on its holder, let its window pass, start it again on ``to``."""
    closed = await c[0].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None
    return await _start(to, sid)


def _token(reply) -> dict[str, str]:
    return {"X-Gym-Session-Token": reply.json["mcp"]["headers"]["X-Gym-Session-Token"]}


async def test_forwards_on_a_cached_holder_skip_redis(hosts, redis_server):
    c = await hosts(2)
    sid = new_id()
    reply = await _start(c[0], sid)
    first = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert first.json["worker"] == c[0].id
    assert c[1].app.claims.cached_holder(sid) == c[0].id
    calls = c.redis().info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    for expected in range(2, 12):
        touched = await c[1].request("POST", "/touch", cookie=reply.cookie)
        assert touched.json == {"worker": c[0].id, "sid": sid, "count": expected}
    after = c.redis().info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert after - calls == 0  # ten forwards, no claim lookup


async def test_a_session_reclaimed_elsewhere_is_never_served_by_its_cached_holder(hosts):
    c = await hosts(3)
    sid = new_id()
    old = await _start(c[0], sid)
    # MCP calls with only the token: a worker that holds no claim for the id
    # would run the tool on whatever it has (nothing): the case the mark is for.
    called = await c[1].request("POST", "/mcp", count_call(1), headers=_token(old))
    assert called.json["result"]["structuredContent"]["worker"] == c[0].id
    assert c[1].app.claims.cached_holder(sid) == c[0].id
    new = await _move(c, sid, c[2])
    assert c[1].app.claims.cached_holder(sid) == c[0].id  # stale, and still cached
    called = await c[1].request("POST", "/mcp", count_call(2), headers=_token(new))
    assert called.status == 200, called.json
    assert called.json["result"]["structuredContent"] == {"worker": c[2].id, "sid": sid, "count": 0}
    assert c[1].app.claims.cached_holder(sid) == c[2].id  # looked up again
    # The cookie path too: the old holder never claims the id for itself.
    touched = await c[1].request("POST", "/touch", cookie=new.cookie)
    assert touched.json == {"worker": c[2].id, "sid": sid, "count": 1}
    assert sid not in c[0].app.claims


async def test_a_stale_entry_for_a_session_now_nobody_holds_falls_back_to_the_rule(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await _start(c[0], sid)
    assert (await c[1].request("POST", "/touch", cookie=reply.cookie)).json["worker"] == c[0].id
    closed = await c[0].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"
    await c.elapse(WINDOW)
    assert c[1].app.claims.cached_holder(sid) == c[0].id
    # Refused by c[0], looked up afresh (no claim): served as without a cache.
    fresh = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert fresh.status == 200 and fresh.json["worker"] == c[1].id
    assert c[1].app.claims.cached_holder(sid) is None


async def test_a_close_drops_the_entry(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await _start(c[0], sid)
    await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert c[1].app.claims.cached_holder(sid) == c[0].id
    closed = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"
    assert c[1].app.claims.cached_holder(sid) is None


def test_the_cache_is_bounded_and_entries_expire():
    clock = FakeClock()
    cache = OwnerCache(ttl=2.0, size=3, clock=clock)
    for i in range(5):
        cache.put(f"s{i}", "w")
    assert len(cache) == 3 and cache.get("s0") is None and cache.get("s4") == "w"
    cache.get("s2")  # used: the least recently used goes first
    cache.put("s5", "w")
    assert cache.get("s3") is None and cache.get("s2") == "w"
    clock.advance(2.0)
    assert cache.get("s2") is None and len(cache) == 2
    cache.forget("s4")
    assert cache.get("s4") is None
    with pytest.raises(ValueError):
        OwnerCache(size=0)


def test_the_default_cache_holds_at_most_its_size():
    cache = OwnerCache()
    for i in range(cache.size * 2):
        cache.put(str(i), "w")
    assert len(cache) == cache.size
