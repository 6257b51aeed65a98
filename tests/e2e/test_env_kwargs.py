"""``serve --env-kwargs JSON``: every session's env is made with those keyword arguments.

Seen over HTTP from real servers: with several workers the arguments reach
spawned workers (inside the pickled target), with one worker the in-process
server. Refusals of bad values are in ``test_cli.py``.
"""

from __future__ import annotations

import http.client
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import gymnasium
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.server.process import start_server

pytestmark = pytest.mark.e2e


def post(connection: http.client.HTTPConnection, path: str, body: dict, cookie: str = ""):
    headers = {"Content-Type": "application/json", **({"Cookie": cookie} if cookie else {})}
    connection.request("POST", path, json.dumps(body), headers)
    reply = connection.getresponse()
    return reply, reply.read()


def test_counter_sessions_render_in_the_mode_the_server_was_given(serve):
    # CounterEnv(render_mode=None) renders nothing; "ansi" renders the count.
    server = serve("envs.counter:CounterEnv", "--env-kwargs", '{"render_mode": "ansi"}', workers=2)
    address = urlsplit(server.url)
    for initial in range(6):  # new connections: the sessions land on either worker
        connection = http.client.HTTPConnection(address.hostname, address.port, timeout=10)
        try:
            reply, body = post(connection, "/reset", {"options": {"initial_count": initial}})
            assert reply.status == 200, body
            cookie = reply.getheader("Set-Cookie").split(";")[0]
            reply, body = post(connection, "/step", {"action": 2}, cookie)
            assert reply.status == 200, body
            reply, frame = post(connection, "/render", {}, cookie)
            assert reply.status == 200, frame
            assert frame.decode() == f"count={initial + 2}\n"
            reply, body = post(connection, "/close_session", {}, cookie)
            assert reply.status == 200, body
        finally:
            connection.close()


def test_a_registered_id_is_made_with_the_kwargs(serve):
    server = serve("CartPole-v1", "--env-kwargs", '{"max_episode_steps": 3}', workers=1)
    env = gymnasium.make("gym_sessions/Remote-v0", url=server.url)
    try:
        env.reset(seed=0)
        truncations = [env.step(0)[3] for _ in range(3)]
    finally:
        env.close()
    assert truncations == [False, False, True]


LAKE_MODULE = """\
import gymnasium


def make_lake(size, render_mode=None):
    return gymnasium.make(
        "FrozenLake-v1", map_name=f"{size}x{size}", is_slippery=False, render_mode=render_mode
    )
"""


def test_a_factory_gets_the_kwargs_and_a_client_render_mode_beside_them(short_tmp):
    (Path(short_tmp) / "lake.py").write_text(LAKE_MODULE)
    with start_server(
        "lake:make_lake",
        "--env-kwargs",
        '{"size": 8}',
        workers=2,
        tmpdir=os.path.join(short_tmp, "server"),
        env={"PYTHONPATH": short_tmp},
    ) as server:
        env = gymnasium.make("gym_sessions/Remote-v0", url=server.url, render_mode="ansi")
        try:
            assert env.observation_space == gymnasium.spaces.Discrete(64)  # 8x8, not 4x4
            env.reset(seed=0)
            rows = env.render().strip().splitlines()
        finally:
            env.close()
    assert len(rows) == 8  # the session's env was made with size=8 and render_mode="ansi"
