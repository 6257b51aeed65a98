"""Redis is untrusted for integrity: forged or altered entries are 503, never a forward.

In-process workers as hosts on a real redis-server. The "attacker" writes Redis
directly (it has no secret) and runs a listener of its own to catch anything a
worker would forward to it.
"""

from __future__ import annotations

import asyncio

import pytest

from gym_sessions.routing.keys import REGISTRATION_PREFIX, claim_name
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.routing.redis_registry import EntrySigner

from .cluster import Cluster, new_id, redis_backend, wait_until
from .probe_server import ProbeServer


@pytest.fixture
def hosts(start_clusters, redis_server):
    async def make(n: int = 2, **kw) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", 5.0)
        return await start_clusters(ProbeServer, n, claims=redis_server.url, **kw)

    return make


@pytest.fixture
async def trap():
    """A listener on loopback that counts the connections it gets (it must get none)."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield port, connections
    server.close()
    await server.wait_closed()


async def _start(c: Cluster) -> tuple[str, str]:
    sid = new_id()
    reply = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    assert reply.status == 200 and reply.json["worker"] == c[0].id
    return sid, reply.cookie


def _refused_as_unsigned(reply) -> None:
    assert reply.status == 503, reply.json
    assert reply.json["error"]["code"] == "claims_unavailable"
    assert reply.set_cookies == []


async def test_a_rewritten_registration_gets_503_and_no_connection(hosts, trap):
    port, connections = trap
    c = await hosts(2)
    sid, cookie = await _start(c)
    # The attacker points the claimant's registration at its own listener.
    c.redis().set(REGISTRATION_PREFIX + c[0].id, f"127.0.0.1:{port}|{'0' * 32}")
    for _ in range(3):
        _refused_as_unsigned(await c[1].request("POST", "/touch", cookie=cookie))
    assert connections == []
    assert c[0].server.counts[sid] == 0


async def test_a_forged_claim_gets_503_and_no_connection(hosts, trap):
    port, connections = trap
    c = await hosts(2)
    sid, cookie = await _start(c)
    key = RedisClaimStore.key(sid)
    c.redis().set(key, f"{c[1].id}|127.0.0.1:{port}|{'f' * 32}")
    _refused_as_unsigned(await c[1].request("POST", "/touch", cookie=cookie))
    assert connections == []
    # The claimant itself knows its claim from memory and serves on.
    assert (await c[0].request("POST", "/touch", cookie=cookie)).json["count"] == 1


async def test_a_claim_copied_from_another_session_gets_503(hosts):
    c = await hosts(2)
    victim, cookie = await _start(c)
    other = new_id()
    await c[1].request("POST", "/seed_session", {"resources_session_id": other})
    # A genuine value, but signed for another claim name: moving it is no use.
    stolen = c.redis().get(RedisClaimStore.key(other))
    c.redis().set(RedisClaimStore.key(victim), stolen)
    _refused_as_unsigned(await c[1].request("POST", "/touch", cookie=cookie))
    assert c[0].server.counts[victim] == 0


async def test_values_without_the_secret_do_not_verify():
    genuine, forger = EntrySigner("s" * 40), EntrySigner("t" * 40)
    name = claim_name("x")
    value = genuine.claim_value(name, "w1", "127.0.0.1:9")
    assert genuine.read_claim(name, value) == ("w1", "127.0.0.1:9")
    for bad in (
        forger.claim_value(name, "w1", "127.0.0.1:9"),
        value.replace("127.0.0.1:9", "127.0.0.1:10"),
        value.replace("w1", "w2", 1),
        "w1",
        "",
    ):
        with pytest.raises(Exception, match="not signed"):
            genuine.read_claim(name, bad)
    registration = genuine.registration_value("w1", "10.0.0.1:80")
    assert genuine.read_registration("w1", registration) == "10.0.0.1:80"
    with pytest.raises(Exception, match="not signed"):
        genuine.read_registration("w2", registration)


async def test_forwarding_only_goes_to_peer_networks(hosts):
    # Workers listen on 127.0.0.1; the allowed network is elsewhere: even their
    # genuine, signed registrations are not forwarded to.
    c = await hosts(2, peer_networks=("127.0.0.2/32",))
    sid, cookie = await _start(c)
    reply = await c[1].request("POST", "/touch", cookie=cookie)
    assert reply.status == 503 and "outside --peer-network" in reply.json["error"]["message"]
    assert c[0].server.counts[sid] == 0
    # Served where it is held.
    assert (await c[0].request("POST", "/touch", cookie=cookie)).status == 200


async def test_a_vanished_claim_is_written_back_for_its_holder_not_taken_over(hosts):
    c = await hosts(3)
    sid, cookie = await _start(c)
    await c[0].request("POST", "/touch", cookie=cookie)
    for attempt in range(3):
        c.redis().delete(RedisClaimStore.key(sid))  # evicted, a stray DEL, a lost write
        # A cookie request and a typed start (the owner retrying by key) elsewhere:
        # both reach the holder, which still has the one env.
        touched = await c[1 + attempt % 2].request("POST", "/touch", cookie=cookie)
        assert touched.status == 200 and touched.json["worker"] == c[0].id
        assert touched.json["count"] == 2 + attempt
        assert c.claim_owner(sid) == c[0].id
    c.redis().delete(RedisClaimStore.key(sid))
    restart = await c[2].request("POST", "/reset", {"resources_session_id": sid})
    assert restart.status == 200 and restart.json["worker"] == c[0].id
    assert sum(sid in w.server.counts for w in c.workers) == 1  # one env, on its holder


async def test_a_forged_claim_is_written_back_by_its_claimant_not_taken_for_a_takeover(
    hosts, trap, caplog
):
    port, connections = trap
    c = await hosts(2)
    sid, cookie = await _start(c)
    key = RedisClaimStore.key(sid)
    genuine = c.redis().get(key)
    c.redis().set(key, f"{c[1].id}|127.0.0.1:{port}|{'f' * 32}")
    # The claimant closes the session: its store update finds the forged value.
    closed = await c[0].request(
        "POST", "/close_session", {"resources_session_id": sid}, cookie=cookie
    )
    assert closed.status == 200, closed.json
    # Not taken for another worker's claim: written back, with the closed claim's
    # expiry, and still the claimant's to end after the window.
    assert await wait_until(lambda: c.redis().get(key) == genuine), c.redis().get(key)
    assert c.redis().pttl(key) > 0
    assert sid in c[0].app.claims
    assert c.redis().sismember(redis_backend(c[0]).redis_store.index_key, claim_name(sid))
    assert "altered in the claim store" in caplog.text
    assert connections == []
