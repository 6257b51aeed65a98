"""Redis claims: in-process workers as two "hosts" sharing one real redis-server.

Each worker has its own private TCP listener registered in Redis, as on
separate machines; nothing is shared between them but Redis and the secret.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import pytest

from gym_sessions.errors import ClaimsUnavailableError
from gym_sessions.routing.claim_store import LocalClaimStore
from gym_sessions.routing.forward_signature import SIGNATURE_HEADER, ForwardSigner
from gym_sessions.routing.keys import EPOCH_KEY, REGISTRATION_PREFIX
from gym_sessions.routing.owned_claims import EXPIRY_MARGIN_SECONDS, OwnedClaims
from gym_sessions.routing.redis_claims import RESTORE_GRACE_SECONDS, RedisClaimStore
from gym_sessions.routing.redis_connection import connect_redis
from gym_sessions.routing.redis_registry import HEARTBEAT_SECONDS, EntrySigner, WorkerRegistry
from gym_sessions.server.app import WorkerApp
from gym_sessions.settings import SECRET_ENV, Settings

from .cluster import (
    SECRET,
    Cluster,
    Worker,
    count_call,
    holder_of,
    new_id,
    redis_backend,
    wait_until,
)
from .fake_clock import FakeClock
from .probe_agent import ProbeAgent
from .probe_server import ProbeServer

SIGNER = EntrySigner(SECRET)

WINDOW = 1.0
STARTS = ("/seed_session", "/reset", "/blind_start")


@pytest.fixture
def hosts(start_clusters, private_redis_server):
    """Workers whose claim windows pass only when the test says so (`Cluster.elapse`).

    Expiries in Redis (PEXPIRE) and the heartbeat still run on real time.
    """

    async def make(n: int = 2, server=ProbeServer, **kw) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", WINDOW)
        kw.setdefault("clock", FakeClock())
        if server is ProbeServer:
            kw.setdefault("checkpoint_session_starts", STARTS)
        return await start_clusters(server, n, claims=private_redis_server.url, **kw)

    return make


async def crash(worker: Worker) -> None:
    """What SIGKILL leaves behind: no listener, no heartbeat, registration still in Redis."""
    for task in worker.app._background:
        task.cancel()
    assert worker.app._listener is not None
    await worker.app._listener.stop()


async def beat(worker: Worker) -> None:
    """What ``worker``'s next heartbeat does once Redis came back empty, without waiting for it.

    It registers again (the first renewal stamps Redis's new epoch) and writes
    its claims back. ``test_a_worker_whose_registration_lapsed_is_slow_not_gone``
    waits for the real heartbeat to do the same.
    """
    await redis_backend(worker).registry.renew()
    await worker.app.claims.restore()


def end_restore_grace(c: Cluster) -> None:
    """Let `RESTORE_GRACE_SECONDS` pass for Redis, without waiting for them.

    Redis judges the grace by its own clock against the epoch's stamp, so the
    stamp moves back by the grace. The epoch's value changes with it: each
    worker's next renewal writes its claims back once more (they are all there).
    """
    stamp, _, rest = c.redis().get(EPOCH_KEY).partition(":")
    assert int(stamp) > 0  # stamped by a renewal after Redis came back empty
    c.redis().set(EPOCH_KEY, f"{int(stamp) - int(RESTORE_GRACE_SECONDS * 1000)}:{rest}")


def private_address(c: Cluster, worker: Worker) -> str:
    """``host:port`` of ``worker``'s private listener, from its (signed) registration."""
    return c.redis().get(REGISTRATION_PREFIX + worker.id).rpartition("|")[0]


def private_url(c: Cluster, worker: Worker) -> str:
    return "http://" + private_address(c, worker)


async def start(worker: Worker, sid: str):
    reply = await worker.request("POST", "/seed_session", {"resources_session_id": sid})
    assert reply.status == 200, reply.json
    return reply


# The rule across hosts ---------------------------------------------------------------------


async def test_a_start_claims_in_redis_and_the_other_host_forwards_to_it(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    assert c.claim_owner(sid) == c[0].id
    assert c.redis().pttl(RedisClaimStore.key(sid)) == -1  # open: no expiry
    for expected in (1, 2, 3):
        touched = await c[1].request("POST", "/touch", cookie=reply.cookie)
        assert touched.status == 200
        assert touched.json == {"worker": c[0].id, "sid": sid, "count": expected}
    assert c[1].server.counts == {}


async def test_mcp_tool_calls_with_only_the_token_reach_the_claimant_host(hosts):
    c = await hosts(3)
    sid = new_id()
    reply = await start(c[0], sid)
    token = reply.json["mcp"]["headers"]["X-Gym-Session-Token"]
    for i in range(1, 4):
        await c[0].request("POST", "/touch", cookie=reply.cookie)
        called = await c[i % 3].request(
            "POST", "/mcp", count_call(i), headers={"X-Gym-Session-Token": token}
        )
        assert called.status == 200
        assert called.json["result"]["structuredContent"] == {
            "worker": c[0].id,
            "sid": sid,
            "count": i,
        }


async def test_agent_sessions_route_across_hosts_and_release_after_the_receipt(hosts):
    c = await hosts(3, server=ProbeAgent)
    sid = new_id()
    seeded = await c[1].request("POST", "/v1/agent_sessions", {"agent_session_id": sid})
    assert seeded.status == 200 and c.claim_owner(sid) == c[1].id
    for i in range(4):
        bumped = await c[i % 3].request("POST", "/bump", cookie=seeded.cookie)
        assert bumped.json == {"worker": c[1].id, "n": i + 1}
    closed = await c[2].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert closed.json["outcome"] == "closed" and closed.json["worker"] == c[1].id
    again = await c[0].request("POST", "/v1/agent_sessions/close", {"agent_session_id": sid})
    assert again.json == closed.json
    assert await wait_until(lambda: c.claim_owner(sid) is None, WINDOW * 6)


async def test_every_worker_registers_a_private_tcp_address(hosts):
    c = await hosts(3)
    for worker in c.workers:
        host, _, port = private_address(c, worker).rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert 0 < c.redis().pttl(REGISTRATION_PREFIX + worker.id) <= 10_000


async def test_a_closed_session_gets_an_expiry_and_its_claimant_removes_it(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    closed = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.status == 200 and closed.json["outcome"] == "closed"
    key = RedisClaimStore.key(sid)
    assert await wait_until(lambda: c.redis().pttl(key) > 0, within=2)
    assert c.redis().pttl(key) <= (WINDOW + EXPIRY_MARGIN_SECONDS) * 1000
    # A retried start of the closed id still reaches the claimant: 409 session_closed.
    again = await c[1].request("POST", "/seed_session", {"resources_session_id": sid})
    assert again.status == 409 and again.json["error"]["code"] == "session_closed"
    # The claimant's own sweep removes it after the window, long before the expiry.
    await c.elapse(WINDOW * 0.75)
    assert c.claim_owner(sid) == c[0].id
    await c.elapse(WINDOW * 0.25)
    assert c.claim_owner(sid) is None
    assert sid in c[0].server.released
    fresh = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert fresh.status == 200 and fresh.json["worker"] == c[1].id


async def test_store_expiry_follows_open_in_flight_and_idle(private_redis_server):
    client = connect_redis(private_redis_server.url)
    registry = WorkerRegistry(client, "w-expiry", SIGNER)
    claims = OwnedClaims(RedisClaimStore(client, registry, 60), "w-expiry", window=30)
    key = RedisClaimStore.key("s1")

    async def pttl() -> int:
        return await client.pttl(key)

    try:
        await registry.register("127.0.0.1", 9)  # as a worker's start-up does
        assert await claims.claim("s1") is None
        await claims.enter("s1")
        assert await pttl() == -1
        await claims.leave("s1")  # idle, never opened: expires
        assert 0 < await pttl() <= (30 + EXPIRY_MARGIN_SECONDS) * 1000
        await claims.enter("s1")  # a request in flight: no expiry
        assert await pttl() == -1
        claims.mark_open("s1")
        await claims.leave("s1")
        assert await pttl() == -1  # open
        claims.mark_not_open("s1")  # outside a request: synced in the background
        await claims.wait_for_store()
        assert await pttl() > 0
        claims.release_now("s1")
        await claims.wait_for_store()
        assert await client.get(key) is None
    finally:
        await client.aclose()


async def test_only_one_of_many_racing_workers_wins_each_claim(private_redis_server):
    clients = [connect_redis(private_redis_server.url) for _ in range(4)]
    stores = [
        RedisClaimStore(client, WorkerRegistry(client, f"w{i}", SIGNER), 60)
        for i, client in enumerate(clients)
    ]
    sids = [new_id() for _ in range(200)]
    try:
        for i, store in enumerate(stores):
            await store.registry.register("127.0.0.1", 9000 + i)
        results = await asyncio.gather(
            *[asyncio.gather(*[store.create(sid) for sid in sids]) for store in stores]
        )
        for k, sid in enumerate(sids):
            winners = [i for i in range(4) if results[i][k] is None]
            assert len(winners) == 1
            assert {results[i][k] for i in range(4) if i != winners[0]} == {f"w{winners[0]}"}
            assert await stores[1].read(sid) == f"w{winners[0]}"
        # Only the claimant removes: another worker's remove leaves the claim alone.
        loser = next(i for i in range(4) if results[i][0] is not None)
        await stores[loser].remove(sids[0])
        assert await stores[0].read(sids[0]) is not None
    finally:
        for client in clients:
            await client.aclose()


# Dead workers --------------------------------------------------------------------------------


async def test_a_crashed_workers_sessions_get_410_on_the_other_host(hosts):
    c = await hosts(3)
    sid = new_id()
    reply = await start(c[0], sid)
    await crash(c[0])
    gone = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert gone.status == 410 and gone.json["error"]["code"] == "session_gone"
    # The others still claim, forward and serve.
    other = new_id()
    started = await start(c[1], other)
    touched = await c[2].request("POST", "/touch", cookie=started.cookie)
    assert touched.status == 200 and touched.json["worker"] == c[1].id


async def test_an_expired_registration_gives_410_and_the_orphaned_claim_an_expiry(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    await crash(c[0])
    c.redis().delete(REGISTRATION_PREFIX + c[0].id)  # its heartbeat stopped long ago
    gone = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert gone.status == 410
    ttl = c.redis().pttl(RedisClaimStore.key(sid))
    assert 0 < ttl <= (WINDOW + EXPIRY_MARGIN_SECONDS) * 1000
    assert c.claim_owner(sid) == c[0].id  # still 410 until it expires, never empty state


async def test_a_clean_shutdown_unregisters_so_its_sessions_get_410_at_once(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    await c[0].app.shutdown()
    assert c.redis().get(REGISTRATION_PREFIX + c[0].id) is None
    gone = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert gone.status == 410


# Signed private listeners ----------------------------------------------------------------------


def _scope(target: str, headers: list[tuple[bytes, bytes]]) -> dict:
    path, _, query = target.partition("?")
    return {
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
    }


async def _raw_post(address: str, target: str, headers, body: bytes) -> tuple[int, dict]:
    """POST exactly these headers (a client library would add its own)."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = [f"POST {target} HTTP/1.1\r\n".encode(), b"host: worker\r\n"]
    head += [name + b": " + value + b"\r\n" for name, value in headers]
    head.append(f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode())
    writer.write(b"".join(head) + body)
    reply = await reader.read()
    writer.close()
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


SIGNATURE_CASES = [
    "unsigned", "other_secret", "other_worker", "other_body", "digest_of_sent_body",
    "other_cookie", "added_header", "added_mark", "stale", "huge_timestamp", "garbage", "twice",
]  # fmt: skip


@pytest.mark.parametrize("case", SIGNATURE_CASES)
async def test_the_private_listener_refuses_requests_without_a_valid_signature(hosts, case):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    body = b"{}"
    headers = [(b"cookie", f"gym_session={reply.cookie}".encode())]
    signer = ForwardSigner(SECRET)
    scope = _scope("/touch", [(b"host", b"worker"), *headers])

    def sign(*, secret=SECRET, worker=c[0].id, signed_scope=scope, signed_body=body) -> bytes:
        return ForwardSigner(secret).header(signed_scope, signed_body, worker)[1]

    good = sign()
    sent = list(headers)
    if case == "other_secret":
        sent.append((SIGNATURE_HEADER, sign(secret="another secret")))
    elif case == "other_worker":  # signed for a different worker
        sent.append((SIGNATURE_HEADER, sign(worker=c[1].id)))
    elif case == "other_body":
        sent.append((SIGNATURE_HEADER, sign(signed_body=b'{"x": 1}')))
    elif case == "digest_of_sent_body":  # the digest swapped in, the mac left as it was
        timestamp, _, mac = sign(signed_body=b'{"x": 1}').split(b".")
        sent.append((SIGNATURE_HEADER, b".".join([timestamp, sha256(body).encode(), mac])))
    elif case == "other_cookie":
        sent = [(b"cookie", b"gym_session=someone-else"), (SIGNATURE_HEADER, good)]
    elif case == "added_header":
        sent += [(b"x-gym-close-follows", b"1"), (SIGNATURE_HEADER, good)]
    elif case == "added_mark":  # a hop mark (HELD_MARK) nobody signed
        sent += [(b"x-gym-hop-held", b"1"), (SIGNATURE_HEADER, good)]
    elif case == "stale":
        with_old_clock = ForwardSigner(SECRET)
        old = str(int(time.time()) - 120).encode()
        digest = sha256(body).encode()
        mac = with_old_clock._mac(old, c[0].id, scope, digest)
        sent.append((SIGNATURE_HEADER, b".".join([old, digest, mac])))
    elif case == "huge_timestamp":
        sent.append((SIGNATURE_HEADER, b"9" * 5000 + b".x.y"))
    elif case == "garbage":
        sent.append((SIGNATURE_HEADER, b"not-a-signature"))
    elif case == "twice":
        sent += [(SIGNATURE_HEADER, good), (SIGNATURE_HEADER, good)]
    address = private_address(c, c[0])
    status, data = await _raw_post(address, "/touch", sent, body)
    assert status == 403 and data["error"]["code"] == "forbidden", data
    assert c[0].server.counts[sid] == 0  # nothing ran
    # The same request, correctly signed, is served (and counted once).
    status, data = await _raw_post(address, "/touch", [*headers, (SIGNATURE_HEADER, good)], body)
    assert status == 200 and data["count"] == 1
    assert signer.max_age_seconds == 30


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_a_signature_header_from_the_client_is_replaced_when_forwarding(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    touched = await c[1].request(
        "POST",
        "/touch",
        cookie=reply.cookie,
        headers={SIGNATURE_HEADER.decode(): "1.forged"},
    )
    assert touched.status == 200 and touched.json["worker"] == c[0].id


# Redis lost while serving -------------------------------------------------------------------


async def test_lost_redis_gives_503_except_for_own_sessions_and_service_resumes(
    hosts, private_redis_server
):
    c = await hosts(2)
    mine, theirs = new_id(), new_id()
    mine_reply = await start(c[0], mine)
    theirs_reply = await start(c[1], theirs)
    private_redis_server.stop()

    # Own sessions known in memory keep working on their claimant.
    own = await c[0].request("POST", "/touch", cookie=mine_reply.cookie)
    assert own.status == 200 and own.json == {"worker": c[0].id, "sid": mine, "count": 1}
    # Everything that needs the store gets 503 claims_unavailable, never local handling.
    for worker, path, kwargs in [
        (c[0], "/touch", {"cookie": theirs_reply.cookie}),  # another worker's session
        (c[0], "/seed_session", {"body": {"resources_session_id": new_id()}}),  # a start
        (c[1], "/touch", {"cookie": mine_reply.cookie}),
    ]:
        refused = await worker.request(
            "POST", path, kwargs.get("body"), cookie=kwargs.get("cookie")
        )
        assert refused.status == 503, refused.json
        assert refused.json["error"]["code"] == "claims_unavailable"
    assert theirs not in c[0].server.counts and mine not in c[1].server.counts
    # Requests that name no session never ask the store.
    for path in ("/health", "/nothing"):
        assert (await c[1].request("GET", path)).status == 200

    # Redis comes back empty (no persistence): each worker's heartbeat writes its
    # registration and its claims again, and routing resumes.
    private_redis_server.start()
    for worker in c.workers:
        await beat(worker)
    assert c.claim_owner(mine) == c[0].id and c.claim_owner(theirs) == c[1].id
    again = await c[1].request("POST", "/touch", cookie=mine_reply.cookie)
    assert again.status == 200 and again.json == {"worker": c[0].id, "sid": mine, "count": 2}
    # New sessions start once the grace for writing claims back is over.
    end_restore_grace(c)
    fresh = new_id()
    await start(c[1], fresh)
    assert c.claim_owner(fresh) == c[1].id


# Start-up ------------------------------------------------------------------------------------


async def test_a_worker_cannot_start_without_redis(short_tmp):
    from tests.services import free_port

    settings = Settings(workers=2, secret=SECRET, claims=f"redis://127.0.0.1:{free_port()}/0")
    app = WorkerApp(ProbeServer(), settings)
    with pytest.raises(ClaimsUnavailableError):
        await app.startup()
    await app.shutdown()


def test_redis_claims_refuse_a_secret_per_host(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="one secret"):
        Settings(claims="redis://127.0.0.1:6379/0")
    monkeypatch.setenv(SECRET_ENV, "shared")
    assert Settings(claims="redis://127.0.0.1:6379/0").secret == "shared"
    assert Settings().secret == "shared"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"claims": "memcached://x"}, "unknown claim store"),
        ({"claims": "redis://127.0.0.1/0", "private_host": "0.0.0.0"}, "wildcard"),
        ({"claims": "redis://10.0.0.5:6379/0"}, "loopback but Redis is on another host"),
        ({"claims": "redis://redis.internal/0", "private_host": "::1"}, "loopback"),
        ({"claims": "redis://10.0.0.5/0", "private_host": "10.0.0.11"}, "--peer-network"),
        (
            {"claims": "redis://10.0.0.5/0", "private_host": "10.0.0.11", "peer_networks": ["x"]},
            "not a CIDR",
        ),
    ],
)
def test_bad_claim_settings_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        Settings(secret="s", **changes)


def test_one_worker_with_redis_claims_still_routes():
    assert Settings(secret="s", claims="redis://127.0.0.1/0").routed
    assert Settings(
        secret="s",
        claims="redis://10.0.0.5/0",
        private_host="10.0.0.11",
        peer_networks=("10.0.0.0/24",),
    ).routed
    assert not Settings(
        secret="s", claims="unix:///run/redis.sock", routes_sessions_to_holder=False
    ).routed
    assert not Settings(secret="s").routed


async def test_local_store_never_expires():
    assert LocalClaimStore.expires is False
    assert await LocalClaimStore().hold("x") is True


async def test_the_reaper_expires_a_dead_workers_forgotten_claims_only(hosts):
    c = await hosts(3)
    forgotten, alive = new_id(), new_id()
    await start(c[0], forgotten)  # open when its worker dies; nobody asks for it again
    await start(c[1], alive)
    await crash(c[0])
    store = c[2].app.claims.store
    assert await store.reap_orphans() == 0  # still registered: maybe only cut off for a beat
    c.redis().delete(REGISTRATION_PREFIX + c[0].id)
    assert await store.reap_orphans() == 1
    ttl = c.redis().pttl(RedisClaimStore.key(forgotten))
    assert 0 < ttl <= (WINDOW + EXPIRY_MARGIN_SECONDS) * 1000
    assert not c.redis().exists(RedisClaimStore.index_prefix + c[0].id)
    # The live worker's claim and index are untouched.
    assert c.redis().pttl(RedisClaimStore.key(alive)) == -1
    assert c.redis().sismember(
        RedisClaimStore.index_prefix + c[1].id, RedisClaimStore.key(alive).rsplit(":", 1)[1]
    )
    assert await store.reap_orphans() == 0


async def test_a_released_claim_leaves_no_index_entry(hosts):
    c = await hosts(2)
    sid = new_id()
    await start(c[0], sid)
    index = RedisClaimStore.index_prefix + c[0].id
    assert c.redis().scard(index) == 1
    await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None
    assert c.redis().scard(index) == 0


async def test_a_worker_whose_registration_lapsed_is_slow_not_gone(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    # Its registration expired (a Redis stall, lost renewals) while it still listens:
    # readers answer 503 - never a 410 that the worker's next heartbeat would belie.
    c.redis().delete(REGISTRATION_PREFIX + c[0].id)
    slow = await c[1].request("POST", "/touch", cookie=reply.cookie)
    if slow.status == 503:  # (else its heartbeat came first: nobody saw it unregistered)
        assert slow.json["error"]["code"] == "claims_unavailable"
        assert "slow, not gone" in slow.json["error"]["message"]
    else:
        assert slow.status == 200 and slow.json["worker"] == c[0].id
    # Its next heartbeat registers it again and holds the open claim without expiry.
    assert await wait_until(
        lambda: c.redis().pttl(RedisClaimStore.key(sid)) == -1, within=HEARTBEAT_SECONDS * 3
    )
    touched = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert touched.status == 200 and touched.json["worker"] == c[0].id
    assert touched.json["count"] == (1 if slow.status == 503 else 2)


class _FlakyRemovals(RedisClaimStore):
    """Fault injection: the next ``failures`` removals find Redis unreachable."""

    failures = 0

    async def remove(self, session_id: str) -> None:
        if self.failures:
            self.failures -= 1
            raise ClaimsUnavailableError("injected: Redis unreachable for this removal")
        await super().remove(session_id)


@pytest.fixture
async def flaky_claims(private_redis_server):
    client = connect_redis(private_redis_server.url)
    store = _FlakyRemovals(client, WorkerRegistry(client, "w-flaky", SIGNER), 60)
    await store.registry.register("127.0.0.1", 9)
    yield OwnedClaims(store, "w-flaky", window=30), store, client
    await client.aclose()


async def test_a_claim_taken_back_after_a_failed_removal_loses_its_expiry(flaky_claims):
    claims, store, client = flaky_claims
    key = RedisClaimStore.key("s")
    assert await claims.claim("s") is None
    await claims.enter("s")
    await claims.leave("s")  # idle and not open: the key expires
    store.failures = 1
    claims.release_now("s")
    await claims.wait_for_store()
    assert "s" not in claims and holder_of(await client.get(key)) == "w-flaky"  # removal failed
    assert await client.pttl(key) > 0
    # A new start of the same id here takes the leftover claim back ...
    assert await claims.claim("s") is None
    await claims.enter("s")
    claims.mark_open("s")
    await claims.leave("s")
    # ... and, open, it must not expire under the session.
    assert await client.pttl(key) == -1


async def test_a_retried_removal_never_deletes_a_claim_taken_back_meanwhile(flaky_claims):
    claims, store, client = flaky_claims
    assert await claims.claim("s") is None
    store.failures = 1
    claims.release_now("s")
    await claims.wait_for_store()  # failed: the sweep would retry it
    taking = asyncio.ensure_future(claims.claim("s"))
    await asyncio.sleep(0)  # the claim is now waiting on Redis
    claims.sweep()
    assert await taking is None
    await claims.wait_for_store()
    assert holder_of(await client.get(RedisClaimStore.key("s"))) == "w-flaky"
    assert "s" in claims


async def test_a_claim_miss_right_after_redis_came_back_empty_is_503_not_a_takeover(
    hosts, private_redis_server
):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    private_redis_server.stop()
    private_redis_server.start()  # empty
    # Until its claimant writes the claim back, nobody may take the session over,
    # by any request (a cookie, a retried start, a close): 503, or, if the
    # claimant's heartbeat was quicker, served by the claimant.
    typed = {"resources_session_id": sid}
    for path, body, cookie in [
        ("/touch", None, reply.cookie),
        ("/seed_session", typed, None),
        ("/close_session", typed, None),
    ]:
        early = await c[1].request("POST", path, body, cookie=cookie)
        if early.status == 503:
            assert early.json["error"]["code"] == "claims_unavailable"
        else:
            assert early.status == 200 and c.claim_owner(sid) == c[0].id, early.json
        if path == "/seed_session":  # a brand-new session waits out the grace too
            brand_new = await c[1].request("POST", path, {"resources_session_id": new_id()})
            assert brand_new.status == 503
    assert c[1].server.counts == {}
    await beat(c[0])
    assert c.claim_owner(sid) == c[0].id
    touched = await c[1].request("POST", "/touch", cookie=reply.cookie)
    assert touched.status == 200 and touched.json["worker"] == c[0].id
    assert c[1].server.counts == {}
    # After the grace period a miss is a miss again: an unknown id is served where it lands.
    end_restore_grace(c)
    unknown = await c[1].request("POST", "/touch", cookie=c.cookie_for(new_id()))
    assert unknown.status == 200 and unknown.json["worker"] == c[1].id


async def test_a_worker_cut_off_from_redis_too_long_stops_serving_its_sessions(hosts):
    c = await hosts(2)
    sid = new_id()
    reply = await start(c[0], sid)
    for task in c[0].app._background:  # its heartbeat stops ...
        task.cancel()
    registry = redis_backend(c[0]).registry
    assert registry is not None and registry.registered_within(5)
    registry.last_registered -= 3600  # ... and its last registration is long past
    for worker in (c[0], c[1]):  # on the claimant itself, and forwarded to it
        refused = await worker.request("POST", "/touch", cookie=reply.cookie)
        assert refused.status == 503 and refused.json["error"]["code"] == "claims_unavailable"
    assert c[0].server.counts[sid] == 0


async def test_an_idle_claim_that_cannot_be_held_again_is_not_served(
    flaky_claims, private_redis_server
):
    claims, _, _ = flaky_claims
    assert await claims.claim("s") is None
    await claims.enter("s")
    await claims.leave("s")  # idle and not open: its key now expires by itself
    private_redis_server.stop()
    # Its expiry cannot be lifted, so another worker might take it once the
    # key expires: refuse rather than serve, and leave nothing in flight.
    with pytest.raises(ClaimsUnavailableError):
        await claims.enter("s")
    assert claims._claims["s"].in_flight == 0
    private_redis_server.start()


async def test_a_renewal_after_a_long_silence_asks_for_the_claims_to_be_written_back(
    private_redis_server,
):
    now = [1000.0]
    client = connect_redis(private_redis_server.url)
    registry = WorkerRegistry(client, "w-quiet", SIGNER, clock=lambda: now[0])
    try:
        await registry.register("127.0.0.1", 9)
        now[0] += HEARTBEAT_SECONDS
        assert await registry.renew() is True
        # Renewals whose replies were lost: Redis may have seen the registration
        # lapse (and readers give its claims an orphan's expiry) even though it
        # exists again now.
        now[0] += 11
        assert await registry.renew() is False
        now[0] += HEARTBEAT_SECONDS
        assert await registry.renew() is True
    finally:
        await client.aclose()
