"""Balanced placement (``--placement balanced``): in-process workers on a real runtime directory.

Every start is accepted by a worker the test chooses (worker 0 unless said
otherwise, the kernel's favourite in a real burst); placement must spread the
sessions, never pick a draining, full or gone worker, and never lose a start.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter

import pytest

from gym_sessions.routing.placement import FileLoadBoard, WorkerLoad
from gym_sessions.wire import START_BESIDE_HEADER

from .cluster import Cluster, dead_worker_id, new_id, seed_start, wait_until
from .probe_server import ProbeServer


@pytest.fixture
def cluster(cluster):
    """The shared `cluster` (conftest) with balanced placement, 4 workers unless said."""

    async def make(n: int = 4, **settings) -> Cluster:
        return await cluster(n, placement="balanced", **settings)

    return make


async def _minted_start(worker):
    return await worker.request("POST", "/seed_session", {})


def test_a_file_board_shows_each_worker_its_peers_records(short_tmp):
    directory = os.path.join(short_tmp, "load")
    a, b = FileLoadBoard(directory, "a"), FileLoadBoard(directory, "b")
    assert a.read_now() == {"b": WorkerLoad(0, True)}
    b.publish(7, True)
    assert a.read_now() == {"b": WorkerLoad(7, True)}  # shared memory: at once
    b.publish(7, False)
    assert a.read_now() == {"b": WorkerLoad(7, False)}
    # A record whose worker process exited (SIGKILL leaves it) is never read.
    dead = FileLoadBoard(directory, dead_worker_id())
    dead.publish(0, True)
    assert set(a.read_now()) == {"b"}
    # A file that is not a record (too short) is ignored, not a crash.
    with open(os.path.join(directory, "junk"), "wb") as file:
        file.write(b"x")
    assert set(a.read_now()) == {"b"}
    asyncio.run(b.close())
    assert a.read_now() == {}
    asyncio.run(a.close())
    asyncio.run(dead.close())


async def test_starts_accepted_by_one_worker_spread_evenly(cluster):
    c = await cluster(4)
    replies = [await seed_start(c[0]) for _ in range(20)]
    assert [r.status for r in replies] == [200] * 20
    if c.settings.redis_claims:
        # Loads reach Redis one round trip late: even, within the bound.
        assert min(c.live_sessions()) >= 2 and sum(c.live_sessions()) == 20
    else:
        assert c.live_sessions() == [5, 5, 5, 5]
    # Each session lives where its claim says, and its cookie reaches it from anywhere.
    for reply in replies:
        sid = reply.json["resources_session_id"]
        assert c.claim_owner(sid) == reply.json["worker"]
        touched = await c[3].request("POST", "/touch", cookie=reply.cookie)
        assert touched.status == 200 and touched.json["worker"] == reply.json["worker"]


async def test_minted_ids_are_placed_too(cluster):
    c = await cluster(2)
    replies = [await _minted_start(c[0]) for _ in range(6)]
    assert [r.status for r in replies] == [200] * 6
    assert min(c.live_sessions()) >= 2


async def test_a_concurrent_burst_on_one_worker_reaches_every_worker(cluster):
    c = await cluster(4)
    replies = await asyncio.gather(*[seed_start(c[0]) for _ in range(40)])
    assert [r.status for r in replies] == [200] * 40, [r.json for r in replies]
    placed = Counter(r.json["worker"] for r in replies)
    assert sum(c.live_sessions()) == 40 and sorted(placed.values()) == sorted(c.live_sessions())
    # Never all (or most) on the accepting worker: every worker gets a real share.
    assert min(c.live_sessions()) >= 4, c.live_sessions()


async def test_a_restart_stays_with_its_holder(cluster):
    c = await cluster(3)
    sid = new_id()
    first = await seed_start(c[0], sid)
    holder = first.json["worker"]
    for worker in c.workers:
        again = await seed_start(worker, sid)
        assert again.status == 200 and again.json["worker"] == holder
    assert sum(c.live_sessions()) == 1


async def test_a_draining_worker_is_never_chosen(cluster):
    c = await cluster(3)
    c[1].app.begin_drain()
    replies = [await seed_start(c[0]) for _ in range(12)]
    assert [r.status for r in replies] == [200] * 12
    assert c.live_sessions()[1] == 0 and sum(c.live_sessions()) == 12
    # A draining acceptor places every start elsewhere.
    more = [await seed_start(c[1]) for _ in range(4)]
    assert [r.status for r in more] == [200] * 4 and c.live_sessions()[1] == 0


async def test_full_workers_are_never_chosen_and_a_full_server_says_so(cluster):
    c = await cluster(4, max_sessions=2)
    replies = [await seed_start(c[0]) for _ in range(8)]
    assert [r.status for r in replies] == [200] * 8
    assert c.live_sessions() == [2, 2, 2, 2]
    full = await seed_start(c[0])
    assert full.status == 503 and full.json["error"]["code"] == "capacity_reached"
    assert "x-gym-no-room" not in full.headers
    assert all(w.app.claims._reserved == 0 for w in c.workers)


async def test_a_chosen_worker_that_refuses_passes_the_start_on(cluster):
    # Worker 1 is full but its record claims room (a stale record): it refuses
    # with its private no-room mark, and the start goes on to another worker.
    c = await cluster(3, max_sessions=1)
    assert (await seed_start(c[1])).status == 200
    assert c.live_sessions() == [0, 1, 0]
    assert (await seed_start(c[0])).status == 200  # worker 0 or 2
    stale = c[1].app.router.placement
    assert stale is not None
    stale.board.publish(0, True)  # lies: 0 sessions, room
    if c.settings.redis_claims:
        await asyncio.sleep(0.1)  # the lie reaches Redis
    third = await seed_start(c[0])
    assert third.status == 200 and third.json["worker"] != c[1].id
    assert sorted(c.live_sessions()) == [1, 1, 1]
    refused = await seed_start(c[0])
    assert refused.status == 503 and refused.json["error"]["code"] == "capacity_reached"


async def test_a_full_worker_hands_a_start_on_to_the_least_loaded_worker(cluster):
    # A start asking to open beside a session of its full acceptor is handed
    # on by the load records (fewest sessions first), not in random order.
    c = await cluster(3, max_sessions=2)
    leader = await seed_start(c[0])
    assert leader.status == 200 and leader.json["worker"] == c[0].id  # a tie stays
    beside = {START_BESIDE_HEADER: leader.cookie or ""}

    async def start_beside():
        body = {"resources_session_id": new_id()}
        return await c[0].request("POST", "/seed_session", body, headers=beside)

    assert (await start_beside()).json["worker"] == c[0].id  # room beside it: now full
    assert (await seed_start(c[1])).json["worker"] == c[1].id  # a tie stays
    assert c.live_sessions() == [2, 1, 0]
    if c.settings.redis_claims:  # the loads reach Redis (each board's writer is done)
        boards = [w.app.router.placement.board for w in c.workers]
        assert await wait_until(lambda: all(b._written == b._value for b in boards))
    handed = await start_beside()
    assert handed.status == 200 and handed.json["worker"] == c[2].id
    assert c.live_sessions() == [2, 1, 1]


async def test_a_gone_worker_loses_no_start(cluster):
    c = await cluster(3)
    await c[1].kill()  # its record stays, at 0 sessions: the first choice each time
    replies = [await seed_start(c[0]) for _ in range(8)]
    assert [r.status for r in replies] == [200] * 8
    assert {r.json["worker"] for r in replies} <= {c[0].id, c[2].id}
    assert c.live_sessions()[0] + c.live_sessions()[2] == 8


async def test_local_placement_starts_where_the_start_arrived(start_clusters):
    c = await start_clusters(ProbeServer, 3, placement="local")
    replies = [await seed_start(c[0]) for _ in range(6)]
    assert {r.json["worker"] for r in replies} == {c[0].id}
    assert c[0].app.router.placement is None
