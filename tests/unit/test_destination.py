"""The shared answer to "who serves this session's request" (`routing/destination.py`).

The router and step batches both act on it; the in-process tests show that a
``/step`` and a batch entry meet the same answers on real workers.
"""

from __future__ import annotations

import pytest

from envs.counter import CounterEnv
from gym_sessions.routing.destination import Destination, Serve, held_elsewhere, of_holder
from gym_sessions.server.env_server import GymEnvServer

from .cluster import new_id, send

ME, OTHER = "100-aaaa", "200-bbbb"


@pytest.mark.parametrize("may_forward", [True, False])
def test_a_session_held_here_or_by_nobody_is_served_here(may_forward):
    assert of_holder(None, ME, may_forward=may_forward) == Destination(Serve.HERE)
    assert of_holder(ME, ME, may_forward=may_forward) == Destination(Serve.HERE)


def test_a_session_held_elsewhere_goes_there_only_if_the_request_may_move():
    assert of_holder(OTHER, ME, may_forward=True) == Destination(Serve.THERE, OTHER)
    assert of_holder(OTHER, ME, may_forward=False) == Destination(Serve.NOBODY, OTHER)
    error = held_elsewhere("abc", OTHER)
    assert (error.status, error.code) == (409, "session_conflict")
    assert OTHER in error.message and "'abc'" in error.message


def counter_server() -> GymEnvServer:
    return GymEnvServer(CounterEnv, name="counter")


async def test_a_private_step_and_a_private_batch_entry_meet_the_same_409(start_clusters):
    # Over a private socket (a request that already moved once) a session held by
    # another worker is a lost race for both, never a second hop and never a run.
    c = await start_clusters(counter_server, 2)
    sid = new_id()
    start = await c[0].request(
        "POST", "/reset", {"resources_session_id": sid, "options": {"initial_count": 7}}
    )
    assert start.status == 200 and start.cookie is not None
    async with c.private_client(c[1]) as client:
        step = await send(client, "POST", "/step", {"action": 1}, cookie=start.cookie)
        batch = await send(
            client, "POST", "/step_batch", {"entries": [{"cookie": start.cookie, "action": 1}]}
        )
    assert step.status == 409
    (entry,) = batch.json["results"]
    assert batch.status == 200 and entry["status"] == 409
    assert entry["error"] == step.json["error"]
    assert entry["error"]["code"] == "session_conflict" and c[0].id in entry["error"]["message"]
    assert entry["worker"] == c[0].id
    # Neither ran: the holder's count is where the start left it.
    public = await c[1].request("POST", "/step", {"action": 0}, cookie=start.cookie)
    assert public.status == 200 and public.json["observation"] == 7


async def test_a_public_step_and_batch_entry_reach_the_holder(start_clusters):
    c = await start_clusters(counter_server, 2)
    sid = new_id()
    start = await c[0].request(
        "POST", "/reset", {"resources_session_id": sid, "options": {"initial_count": 7}}
    )
    step = await c[1].request("POST", "/step", {"action": 2}, cookie=start.cookie)
    batch = await c[1].request(
        "POST", "/step_batch", {"entries": [{"cookie": start.cookie, "action": 3}]}
    )
    assert step.status == 200 and step.json["observation"] == 9
    (entry,) = batch.json["results"]
    assert entry["observation"] == 12 and entry["worker"] == c[0].id
