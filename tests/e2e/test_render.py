"""Rendering over HTTP: ``render_mode`` at session start, binary frames from ``POST /render``."""

from __future__ import annotations

import asyncio
import json
import urllib.request
import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env
from gymnasium.wrappers import HumanRendering, RenderCollection

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv, RemoteEnv
from gym_sessions.client.http import HTTPClient
from gym_sessions.errors import InvalidRequestError, NoOpenEpisodeError, SessionClosedError
from gym_sessions.server.process import start_server

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"


HEADLESS = {"SDL_VIDEODRIVER": "dummy"}  # pygame never needs a display


@pytest.fixture(autouse=True)
def _headless(monkeypatch):
    for name, value in HEADLESS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture(scope="module")
def cartpole():
    with start_server("CartPole-v1", env=HEADLESS) as server:
        yield server


@pytest.fixture(scope="module")
def cartpole2():
    with start_server("CartPole-v1", workers=2, env=HEADLESS) as server:
        yield server


@pytest.fixture(scope="module")
def counter():
    with start_server("envs.counter:CounterEnv") as server:
        yield server


def post_raw(url: str, path: str, cookie: str | None) -> tuple[int, dict[str, str], bytes]:
    headers = {"Content-Type": "application/json"}
    if cookie:
        headers["Cookie"] = f"gym_session={cookie}"
    request = urllib.request.Request(url + path, data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, error.read()


def test_check_env_with_render_check_passes_for_cartpole(cartpole):
    server = cartpole
    env = gym.make(REMOTE, url=server.url, render_mode="rgb_array")
    try:
        assert env.metadata["render_modes"] == ["rgb_array"]  # "human" stays on the server
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
        # check_env only warns about bad frames: none may be about rendering.
        assert not [w for w in caught if "render" in str(w.message).lower()]
    finally:
        env.close()


def test_rgb_frames_are_the_served_envs_pixels_as_raw_bytes(cartpole):
    server = cartpole
    local = gym.make("CartPole-v1", render_mode="rgb_array")
    remote = gym.make(REMOTE, url=server.url, render_mode="rgb_array")
    try:
        local.reset(seed=4)
        remote.reset(seed=4)
        for action in [1, 1, 0, 1]:
            local.step(action)
            remote.step(action)
        frame = remote.render()
        assert frame.dtype == np.uint8 and frame.shape == (400, 600, 3)
        np.testing.assert_array_equal(frame, local.render())
        frame[0, 0] = 0  # frames are the caller's to change

        client = remote.unwrapped._http
        status, headers, body = post_raw(server.url, "/render", client.cookie)
        assert status == 200
        assert headers["content-type"] == "application/octet-stream"
        assert headers["x-gym-frame-dtype"] == "|u1"
        assert headers["x-gym-frame-shape"] == "400,600,3"
        assert len(body) == 400 * 600 * 3
    finally:
        local.close()
        remote.close()


def test_frames_survive_the_routing_hop(cartpole2):
    server = cartpole2
    env = RemoteEnv(server.url, render_mode="rgb_array")
    try:
        env.reset(seed=1)
        frame = env.render()
        # A kept-alive connection accepted by the other worker: its render is forwarded.
        for _ in range(50):
            other = HTTPClient(server.url)
            if other.request("GET", "/health")["worker"] != env.worker:
                break
            other.close()
        else:
            pytest.fail("the kernel gave 50 connections in a row to the same worker")
        other.cookie = env._http.cookie
        reply = other.send(env._protocol.render_request())
        assert other.request("GET", "/health")["worker"] == env.worker  # routed by cookie
        np.testing.assert_array_equal(env._protocol.render_reply(reply), frame)
        other.close()
    finally:
        env.close()


def test_ansi_render_of_the_counter(counter):
    server = counter
    env = gym.make(REMOTE, url=server.url, render_mode="ansi")
    try:
        env.reset(options={"initial_count": 3})
        env.step(4)
        assert env.render() == "count=7\n"
        status, headers, body = post_raw(server.url, "/render", env.unwrapped._http.cookie)
        assert status == 200 and headers["content-type"].startswith("text/plain")
        assert body == b"count=7\n"
        # Without a render mode, render() asks nothing of the server.
        plain = gym.make(REMOTE, url=server.url)
        plain.reset()
        assert plain.render() is None
        plain.close()
    finally:
        env.close()
    # A closed session renders nothing.
    status, _, body = post_raw(server.url, "/render", env.unwrapped._http.cookie)
    assert status == SessionClosedError.status
    assert json.loads(body)["error"]["code"] == "session_closed"


def test_modes_the_env_does_not_list_are_refused(counter):
    server = counter
    with pytest.raises(ValueError, match="rgb_array"):
        RemoteEnv(server.url, render_mode="rgb_array")
    # The server refuses it too, and a session without an env has nothing to render.
    client = HTTPClient(server.url)
    with pytest.raises(InvalidRequestError, match="render_mode"):
        client.request("POST", "/reset", {"render_mode": "rgb_array"})
    with pytest.raises(NoOpenEpisodeError):
        client.request("POST", "/render", {})
    # A session keeps the render mode it started with.
    client.request("POST", "/reset", {"render_mode": "ansi"})
    with pytest.raises(InvalidRequestError, match="renders in mode 'ansi'"):
        client.request("POST", "/reset", {"render_mode": "human"})
    client.close()


def test_async_and_vector_envs_render(cartpole2):
    server = cartpole2

    async def one_frame() -> np.ndarray:
        async with AsyncRemoteEnv(server.url, render_mode="rgb_array") as env:
            await env.reset(seed=2)
            return await env.render()

    assert asyncio.run(one_frame()).shape == (400, 600, 3)
    with pytest.raises(ValueError, match="human"):
        asyncio.run(AsyncRemoteEnv.create(server.url, render_mode="human"))

    envs = gym.make_vec(REMOTE, num_envs=3, url=server.url, render_mode="rgb_array")
    try:
        envs.reset(seed=[2, 2, 5])
        frames = envs.render()
        assert len(frames) == 3 and all(f.shape == (400, 600, 3) for f in frames)
        np.testing.assert_array_equal(frames[0], frames[1])
        assert not np.array_equal(frames[0], frames[2])
    finally:
        envs.close()


def test_human_and_list_modes_are_made_locally_from_rgb_frames(cartpole):
    human = gym.make(REMOTE, url=cartpole.url, render_mode="human")
    try:
        assert isinstance(human, HumanRendering)  # a local window (headless here)
        assert human.unwrapped.render_mode == "rgb_array"
        human.reset(seed=0)
        human.step(0)
    finally:
        human.close()
    collected = gym.make(REMOTE, url=cartpole.url, render_mode="rgb_array_list")
    try:
        assert isinstance(collected, RenderCollection)
        collected.reset(seed=0)
        collected.step(1)
        frames = collected.render()
        assert len(frames) == 2 and all(f.shape == (400, 600, 3) for f in frames)
    finally:
        collected.close()
