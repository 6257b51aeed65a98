"""A Redis that hangs (SIGSTOP): 503 within ``claims_timeout``, never 410, then 200 again.

In-process workers as two hosts on one real redis-server. A frozen Redis accepts
connections and never answers; every request that needs it must fail once one
deadline has passed (waiting for a pooled connection included, not a pool wait
and a reply timeout one after the other), while each worker keeps serving the
sessions it holds in memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest

from .cluster import Cluster, new_id
from .probe_server import ProbeServer

DEADLINE = 1.0
# More requests at once than the Redis pool has connections (64): the rest
# wait for a connection, and that wait counts toward the same deadline.
BURST = 80


@pytest.fixture
def hosts(start_clusters, private_redis_server):
    async def make() -> Cluster:
        return await start_clusters(
            ProbeServer, 2, claims=private_redis_server.url, claims_timeout=DEADLINE
        )

    return make


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """Redis stopped (its connections open, nothing answered) for the block."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_a_frozen_redis_gets_503_within_the_deadline_and_sessions_come_back(
    hosts, private_redis_server
):
    c = await hosts()
    sid = new_id()
    started = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    assert started.status == 200, started.json
    cookie = started.cookie
    assert (await c[1].request("POST", "/touch", cookie=cookie)).json["worker"] == c[0].id

    # The same burst with Redis answering: what the requests cost here
    # without the deadline (the machine may be busy).
    began = time.monotonic()
    await asyncio.gather(*(c[1].request("POST", "/touch", cookie=cookie) for _ in range(BURST)))
    unfrozen = time.monotonic() - began

    # c[1] now has c[0] cached as the holder and would serve on that (the
    # holder checks it): here every request must ask Redis.
    c[1].app.claims.forget_holder(sid)
    with frozen(private_redis_server.process.pid):
        began = time.monotonic()
        # Bounded here so that, should the deadline not hold, the test fails
        # instead of waiting for as long as Redis stays frozen.
        replies = await asyncio.wait_for(
            asyncio.gather(*(c[1].request("POST", "/touch", cookie=cookie) for _ in range(BURST))),
            timeout=DEADLINE * 10 + unfrozen,
        )
        elapsed = time.monotonic() - began
        # The claimant serves its own session from memory meanwhile.
        own = await c[0].request("POST", "/touch", cookie=cookie)

    assert [r.status for r in replies] == [503] * BURST
    assert {r.json["error"]["code"] for r in replies} == {"claims_unavailable"}
    assert all("did not answer within 1 s" in r.json["error"]["message"] for r in replies)
    # One deadline for all of them, not one per wait: those that waited for
    # a pooled connection would then take two deadlines.
    assert elapsed < DEADLINE * 1.75 + unfrozen, (elapsed, unfrozen)
    assert own.status == 200 and own.json["worker"] == c[0].id

    # Redis answers again: the same session is served where it lives, never 410.
    after = [await c[1].request("POST", "/touch", cookie=cookie) for _ in range(5)]
    assert [r.status for r in after] == [200] * 5, [r.json for r in after]
    assert {r.json["worker"] for r in after} == {c[0].id}
    assert c[0].server.counts[sid] == 1 + BURST + 1 + 5
