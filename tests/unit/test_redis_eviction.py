"""A Redis that starts evicting at run time is noticed: missing claims are 503, never 404.

The start-up check refuses a Redis whose ``maxmemory-policy`` evicts; these
tests turn eviction on afterwards (``CONFIG SET``) on a private redis-server,
fill it until claims are evicted, and ask for every session through a worker
that does not hold it (which must read Redis to find the holder).
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from envs.counter import CounterEnv
from gym_sessions.routing.keys import KEY_PREFIX
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.server.env_server import GymEnvServer

from .cluster import Cluster, new_id, wait_until

# Redis claims never hand connections over: one run, with the hop.
pytestmark = pytest.mark.hop_only

SESSIONS = 30


def _counter_server() -> GymEnvServer:
    return GymEnvServer(CounterEnv, "counter")


@pytest.fixture
def hosts(start_clusters, private_redis_server):
    async def make(n: int = 2) -> Cluster:
        return await start_clusters(
            _counter_server,
            n,
            claims=private_redis_server.url,
            session_close_retry_window_seconds=5.0,
        )

    return make


async def _open_sessions(c: Cluster) -> dict[str, str]:
    """``SESSIONS`` sessions started at worker 0, one step each; their cookies."""
    cookies = {}
    for _ in range(SESSIONS):
        sid = new_id()
        reply = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
        assert reply.status == 200, reply.json
        step = await c[0].request("POST", "/step", {"action": 3}, cookie=reply.cookie)
        assert step.status == 200
        cookies[sid] = reply.cookie
    return cookies


def _evict_claims(c: Cluster, sids: list[str]) -> int:
    """Turn LRU eviction on with little memory and fill Redis until half the claims are gone.

    Returns how many went. The claims and their worker's index are older than
    the filler, so LRU takes them first; without the index nothing tells a
    reader that the session exists. The epoch key is read as the filling goes
    (its loss alone would make every miss 503: Redis looks freshly emptied).
    """
    r = c.redis()
    used = int(r.info("memory")["used_memory"])
    r.config_set("maxmemory-policy", "allkeys-lru")
    r.config_set("maxmemory", str(used + 2 * 1024 * 1024))
    keys = [RedisClaimStore.key(sid) for sid in sids]
    filler = "x" * 10_000
    for index in range(5_000):
        r.set(f"filler:{index}", filler)
        if index % 20 == 0:
            r.get(KEY_PREFIX + "epoch")
            if sum(r.exists(key) for key in keys) <= len(keys) // 2:
                break
    # Room again, so nothing more goes while the test asks (still an evicting policy).
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 64 * 1024 * 1024))
    return len(keys) - sum(r.exists(key) for key in keys)


async def _observe_everywhere_else(c: Cluster, cookies: dict[str, str]) -> list[tuple[int, str]]:
    replies = await asyncio.gather(
        *[c[1].request("POST", "/observe", {}, cookie=cookie) for cookie in cookies.values()]
    )
    seen = []
    for reply in replies:
        if reply.status == 200:
            assert reply.json["observation"] == 3, reply.json  # the holder's env, not a new one
            seen.append((200, ""))
        else:
            seen.append((reply.status, reply.json["error"]["code"]))
    return seen


async def test_claims_evicted_at_run_time_are_503_naming_the_cause_never_404(hosts, caplog):
    caplog.set_level(logging.WARNING, logger="gym_sessions")
    c = await hosts(2)
    cookies = await _open_sessions(c)
    evicted = _evict_claims(c, list(cookies))
    assert evicted > 0, "the test filled Redis without evicting a claim"
    seen = await _observe_everywhere_else(c, cookies)
    assert set(seen) <= {(200, ""), (503, "claims_unavailable")}, seen
    assert seen.count((503, "claims_unavailable")) >= evicted
    assert "maxmemory-policy allkeys-lru" in caplog.text
    # A new session cannot start either while claims may vanish: no second env.
    start = await c[1].request("POST", "/seed_session", {"resources_session_id": new_id()})
    assert (start.status, start.json["error"]["code"]) == (503, "claims_unavailable")
    # The holder serves its sessions from memory all along.
    for cookie in cookies.values():
        reply = await c[0].request("POST", "/observe", {}, cookie=cookie)
        assert reply.json["observation"] == 3


async def test_eviction_is_noticed_without_a_request_and_its_end_writes_claims_back(hosts, caplog):
    caplog.set_level(logging.INFO, logger="gym_sessions")
    c = await hosts(2)
    cookies = await _open_sessions(c)
    r = c.redis()
    r.config_set("maxmemory", str(int(r.info("memory")["used_memory"]) + 64 * 1024 * 1024))
    r.config_set("maxmemory-policy", "allkeys-lru")
    # The periodic recheck sees it (about every 10 s), with no request asking.
    assert await wait_until(lambda: "maxmemory-policy allkeys-lru" in caplog.text, within=30)
    evicted = _evict_claims(c, list(cookies))
    assert evicted > 0
    seen = await _observe_everywhere_else(c, cookies)
    assert set(seen) <= {(200, ""), (503, "claims_unavailable")}, seen
    assert seen.count((503, "claims_unavailable")) >= evicted
    r.config_set("maxmemory-policy", "noeviction")
    # Noticed at the next recheck: every holder writes its claims back.
    assert await wait_until(
        lambda: all(r.exists(RedisClaimStore.key(sid)) for sid in cookies), within=30
    )
    seen = await _observe_everywhere_else(c, cookies)
    assert set(seen) == {(200, "")}, seen
