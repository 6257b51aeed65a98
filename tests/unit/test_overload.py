"""Overload answers in JSON: the request-body budget, descriptor exhaustion, unexpected failures."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest

from gym_sessions.routing import stream_forwarder

from .cluster import Cluster, new_id, wait_until
from .probe_server import ProbeServer

KIB = 1024


@pytest.fixture
def cluster(start_clusters):
    async def make(n: int = 2, **kw) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", 1.0)
        return await start_clusters(ProbeServer, n, **kw)

    return make


def _sleep_body(seconds: float, size: int) -> dict:
    return {"seconds": seconds, "pad": "x" * size}


# A body of one long string costs about 3 times its size (`body_cost`): two
# 400 KiB ones take about 2.5 MiB of the 3 MiB budget, a third cannot fit.
BUDGET = {"max_body_bytes": 512 * KIB, "max_inflight_body_bytes": 3 * 1024 * KIB}


async def test_bodies_beyond_the_budget_wait_then_get_503(cluster):
    c = await cluster(1, **BUDGET)
    budget = c[0].app.app.body_budget
    holders = [
        asyncio.ensure_future(c[0].request("POST", "/sleep", _sleep_body(3.0, 400 * KIB)))
        for _ in range(2)
    ]
    assert await wait_until(lambda: budget.held >= 2400 * KIB)
    # No room within the 2 s wait: 503 overloaded, JSON, with Retry-After.
    refused = await c[0].request("POST", "/sleep", _sleep_body(0, 400 * KIB))
    assert refused.status == 503 and refused.json["error"]["code"] == "overloaded"
    assert refused.headers["retry-after"] == "1"
    # Small bodies still fit beside them.
    assert (await c[0].request("POST", "/sleep", _sleep_body(0, 10))).status == 200
    assert [r.status for r in await asyncio.gather(*holders)] == [200, 200]
    assert budget.held == 0


async def test_a_body_waits_for_room_that_frees_within_the_wait(cluster):
    c = await cluster(1, **BUDGET)
    budget = c[0].app.app.body_budget
    holders = [
        asyncio.ensure_future(c[0].request("POST", "/sleep", _sleep_body(0.7, 400 * KIB)))
        for _ in range(2)
    ]
    assert await wait_until(lambda: budget.held >= 2400 * KIB)
    waited = await c[0].request("POST", "/sleep", _sleep_body(0, 400 * KIB))
    assert waited.status == 200
    await asyncio.gather(*holders)
    assert budget.held == 0


async def test_a_body_that_would_parse_beyond_the_whole_budget_gets_413_unparsed(cluster):
    # 512 KiB of empty objects would take about 13 MiB as Python objects: more
    # than the whole 3 MiB budget, so no wait helps; a string body of the same
    # size fits. Either way the worker carries on.
    c = await cluster(1, **BUDGET)
    budget = c[0].app.app.body_budget
    objects = b"[" + b"{}," * (170 * KIB) + b"{}]"
    refused = await c[0].request("POST", "/sleep", raw=objects)
    assert refused.status == 413 and refused.json["error"]["code"] == "body_too_large"
    assert "to parse" in refused.json["error"]["message"]
    assert budget.held == 0
    fits = await c[0].request("POST", "/sleep", _sleep_body(0, len(objects) - 100))
    assert fits.status == 200


async def test_out_of_descriptors_reading_a_claim_is_a_json_503(cluster, monkeypatch):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    real_open = os.open

    def open_without_descriptors(path, *args, **kwargs):
        if "/claims/" in str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_without_descriptors)
    reply = await c[1].request("POST", "/touch", cookie=start.cookie)
    assert reply.status == 503 and reply.json["error"]["code"] == "overloaded"
    assert reply.headers["retry-after"] == "1"
    monkeypatch.setattr(os, "open", real_open)
    # The worker carries on once descriptors are back.
    again = await c[1].request("POST", "/touch", cookie=start.cookie)
    assert again.status == 200 and again.json["worker"] == c[0].id


@pytest.mark.hop_only
async def test_out_of_descriptors_reaching_a_worker_is_not_taken_for_its_death(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    forwarder = c[1].app.forwarder
    real_open = forwarder.endpoints.open

    async def open_without_descriptors(worker_id):
        raise OSError(errno.EMFILE, "Too many open files")

    forwarder._drop_pool(c[0].id)
    forwarder.endpoints.open = open_without_descriptors
    reply = await c[1].request("POST", "/touch", cookie=start.cookie)
    assert reply.status == 503 and reply.json["error"]["code"] == "overloaded"
    forwarder.endpoints.open = real_open
    assert (await c[1].request("POST", "/touch", cookie=start.cookie)).status == 200


async def test_an_unexpected_failure_in_routing_is_a_json_500(cluster, monkeypatch):
    c = await cluster(2)

    async def broken(session_id):
        raise RuntimeError("a bug")

    monkeypatch.setattr(c[1].app.claims, "holder", broken)
    cookie = c.cookie_for(new_id())
    reply = await c[1].request("POST", "/touch", cookie=cookie)
    assert reply.status == 500 and reply.json["error"]["code"] == "internal_error"
    monkeypatch.undo()
    assert (await c[1].request("GET", "/health")).status == 200


@pytest.mark.hop_only
async def test_idle_hop_connections_are_closed(cluster, monkeypatch):
    monkeypatch.setattr(stream_forwarder, "_IDLE_CLOSE_SECONDS", 0.3)
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    replies = await asyncio.gather(
        *[c[1].request("POST", "/touch", cookie=start.cookie) for _ in range(8)]
    )
    assert {r.status for r in replies} == {200}
    forwarder = c[1].app.forwarder
    assert forwarder._idle.get(c[0].id)
    assert await wait_until(lambda: not forwarder._idle, within=3)
