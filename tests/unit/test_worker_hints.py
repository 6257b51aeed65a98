"""The reply headers that name a session's holder and the worker a connection reaches.

A pooling client (`gym_sessions.client.connection_pool`) reads them to send each
session's requests on its holder's connection; here they are checked on real
in-process workers, served locally and relayed.
"""

from __future__ import annotations

from envs.counter import CounterEnv
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.wire import HOLDER_HEADER, RELAYED_BY_HEADER

from .cluster import new_id


def counter_server() -> GymEnvServer:
    return GymEnvServer(CounterEnv, name="counter")


async def test_a_reply_names_its_holder_and_a_relayed_one_its_relay(start_clusters):
    c = await start_clusters(counter_server, 2)
    start = await c[0].request("POST", "/reset", {"resources_session_id": new_id()})
    assert start.status == 200
    assert start.headers.getall(HOLDER_HEADER) == [c[0].id]
    assert RELAYED_BY_HEADER not in start.headers

    here = await c[0].request("POST", "/step", {"action": 1}, cookie=start.cookie)
    assert here.headers.getall(HOLDER_HEADER) == [c[0].id]
    assert RELAYED_BY_HEADER not in here.headers

    elsewhere = await c[1].request("POST", "/step", {"action": 1}, cookie=start.cookie)
    assert elsewhere.status == 200 and elsewhere.json["observation"] == 2
    assert elsewhere.headers.getall(HOLDER_HEADER) == [c[0].id]
    assert_reached_by(c, elsewhere, c[1])

    # A request naming no session holds nothing: no holder to name.
    for path in ("/health", "/spaces"):
        reply = await c[1].request("GET", path)
        assert reply.status == 200 and HOLDER_HEADER not in reply.headers


def assert_reached_by(c, reply, receiver) -> None:
    """The reply says which worker the connection now reaches: the holder once
    handed over (handoff on: the holder itself answered), else the worker that
    received and relayed it."""
    if receiver.app.handoff is not None:
        assert RELAYED_BY_HEADER not in reply.headers
        assert receiver.app.router.deliveries.handed_over >= 1
    else:
        assert reply.headers.getall(RELAYED_BY_HEADER) == [receiver.id]


async def test_an_error_the_holder_sends_names_it_and_a_hint_never_routes(start_clusters):
    # A forged hint header on a request is only a header: the cookie routes it.
    c = await start_clusters(counter_server, 2)
    start = await c[0].request("POST", "/reset", {"resources_session_id": new_id()})
    forged = {HOLDER_HEADER: c[1].id, RELAYED_BY_HEADER: c[1].id}
    bad = await c[1].request("POST", "/step", {"action": 99}, cookie=start.cookie, headers=forged)
    assert bad.status == 400
    assert bad.headers.getall(HOLDER_HEADER) == [c[0].id]
    assert_reached_by(c, bad, c[1])
    step = await c[1].request("POST", "/step", {"action": 1}, cookie=start.cookie, headers=forged)
    assert step.status == 200 and step.json["observation"] == 1


async def test_a_start_a_full_worker_offers_another_names_that_holder_and_its_relay(start_clusters):
    # The other relay path: a full worker hands the start on (`_offer_start`).
    c = await start_clusters(counter_server, 2, max_sessions=1)
    first = await c[0].request("POST", "/reset", {"resources_session_id": new_id()})
    assert first.headers.getall(HOLDER_HEADER) == [c[0].id]
    offered = await c[0].request("POST", "/reset", {"resources_session_id": new_id()})
    assert offered.status == 200
    assert offered.headers.getall(HOLDER_HEADER) == [c[1].id]
    assert offered.headers.getall(RELAYED_BY_HEADER) == [c[0].id]
