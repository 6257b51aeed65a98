"""Binary values between real processes (docs/design.md §3.15): pixel frames bit-exact.

A synthetic Atari-sized env (`PixelEnv`) served by real `gym-sessions serve`
processes, stepped by `RemoteEnv` and `make_vec` beside the same env run
locally: every frame, reward and flag equal, over binary messages (checked on
the wire), and curl-style JSON requests still answered in JSON. The ALE Pong
episode is `test_pong_e2e.py`.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import gymnasium as gym
import numpy as np
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client.exchange import HTTPClientBase, Reply
from gym_sessions.client.protocol import (
    EnvDescription,
    RemoteEnvProtocol,
    batch_request,
    batch_results,
)
from gym_sessions.client.remote_env import RemoteEnv
from gym_sessions.value_messages import BINARY_ACCEPT, BINARY_MEDIA_TYPE
from tests.e2e.pixel_envs import FRAME_SHAPE, FlatFrames, PixelEnv

pytestmark = pytest.mark.e2e

PIXELS = "tests.e2e.pixel_envs:PixelEnv"


def post(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        connection.request("POST", path, body, headers)
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def test_remote_pixel_episode_is_bit_exact_against_local_and_binary(serve):
    server = serve(PIXELS, workers=2)
    remote, local = RemoteEnv(server.url), PixelEnv()
    try:
        assert remote._protocol.description.binary_values
        observation, _ = remote.reset(seed=11)
        expected, _ = local.reset(seed=11)
        assert observation.shape == FRAME_SHAPE and observation.flags.writeable
        np.testing.assert_array_equal(observation, expected)
        rng = np.random.default_rng(5)
        done = False
        while not done:
            action = int(rng.integers(6))
            got, want = remote.step(action), local.step(action)
            assert got[0].dtype == np.uint8
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:] == want[1:]
            done = got[2] or got[3]
    finally:
        remote.close()


def test_make_vec_of_pixel_envs_steps_as_sync_vector_env(serve):
    server = serve(PIXELS, workers=2)
    remote = gym.make_vec("gym_sessions/Remote-v0", num_envs=4, url=server.url)
    local = gym.vector.SyncVectorEnv([PixelEnv for _ in range(4)])
    try:
        observations, _ = remote.reset(seed=3)
        expected, _ = local.reset(seed=3)
        np.testing.assert_array_equal(observations, expected)
        rng = np.random.default_rng(9)
        for _ in range(PixelEnv.EPISODE_STEPS + 3):  # through one autoreset
            actions = rng.integers(0, 6, size=4)
            got, want = remote.step(actions), local.step(actions)
            for part_got, part_want in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(part_got, part_want)
    finally:
        remote.close()
        local.close()


def test_curl_gets_json_and_a_binary_client_gets_binary_from_one_server(serve):
    server = serve(PIXELS)
    status, headers, body = post(server.url, "/reset", b'{"seed": 1}', {})
    assert status == 200 and headers["content-type"] == "application/json"
    as_json = json.loads(body)
    frame = np.array(as_json["observation"], np.uint8)
    expected, _ = PixelEnv().reset(seed=1)
    np.testing.assert_array_equal(frame, expected)
    cookie = headers["set-cookie"].split(";", 1)[0]
    status, headers, body = post(
        server.url, "/observe", b"{}", {"Cookie": cookie, "Accept": BINARY_ACCEPT}
    )
    assert status == 200 and headers["content-type"] == BINARY_MEDIA_TYPE
    assert len(body) < len(json.dumps(as_json)) // 3  # raw bytes, not numbers as text
    status, headers, body = post(
        server.url,
        "/step",
        b"\x00" * 8,
        {"Cookie": cookie, "Content-Type": BINARY_MEDIA_TYPE},
    )
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body)["error"]["code"] == "invalid_binary"


def test_a_binary_batch_across_workers_is_bit_exact(serve):
    """Entries held by several workers: the accepting one sends each holder its binary
    sub-batch (or hands the connection over) and merges their binary results."""
    server = serve(PIXELS, workers=4)
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("GET", "/spaces")
    description = EnvDescription.from_json(json.loads(connection.getresponse().read()))
    connection.close()
    protocol = RemoteEnvProtocol(description)
    cookies, locals_ = [], []
    for seed in range(8):  # a new connection each: the sessions land on any worker
        status, headers, _ = post(server.url, "/reset", json.dumps({"seed": seed}).encode(), {})
        assert status == 200
        cookies.append(headers["set-cookie"].split(";", 1)[0].partition("=")[2])
        locals_.append(PixelEnv())
        locals_[-1].reset(seed=seed)
    workers: set[str] = set()
    rng = np.random.default_rng(1)
    for length in range(3):
        actions = rng.integers(0, 6, size=8).tolist()
        entries = [
            {"cookie": c, "action": protocol.encode_action(a), "episode_length": length}
            for c, a in zip(cookies, actions, strict=True)
        ]
        exchange = HTTPClientBase(server.url).exchange(batch_request("/step_batch", entries))
        status, headers, body = post(server.url, "/step_batch", exchange.payload, exchange.headers)
        assert status == 200 and headers["content-type"] == BINARY_MEDIA_TYPE
        results = batch_results(Reply(200, {"content-type": BINARY_MEDIA_TYPE}, body))
        for env, action, result in zip(locals_, actions, results, strict=True):
            observation, reward, terminated, truncated, _ = env.step(action)
            np.testing.assert_array_equal(protocol.step_result(result)[0], observation)
            assert (result["reward"], result["terminated"], result["truncated"]) == (
                reward,
                terminated,
                truncated,
            )
            workers.add(result["worker"])
    assert len(workers) >= 2  # the batch crossed workers


@pytest.mark.parametrize("handoff", ["on", "off"])
def test_compressed_frames_across_workers_are_exact_and_compressed_once(serve, handoff):
    # Frames as Atari's compress about 500 times; with zstd asked for (as a
    # client beyond loopback asks), every request on a new connection so most
    # reach a worker that does not hold the session (handed over, or hopped),
    # each reply comes compressed once and decodes to the local env's frame.
    server = serve(
        "tests.e2e.pixel_envs:FlatFrames",
        "--handoff",
        handoff,
        "--debug-worker-header",
        workers=4,
    )
    remote = RemoteEnv(server.url, keep_alive=False, headers={"Accept-Encoding": "zstd"})
    local = FlatFrames()
    try:
        np.testing.assert_array_equal(remote.reset(seed=3)[0], local.reset(seed=3)[0])
        for action in [1, 3, 0, 2] * 3:
            got, want = remote.step(action), local.step(action)
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:] == want[1:]
        cookie = f"gym_session={remote._http.cookie}"
        elsewhere = 0  # replies from a worker other than the one that accepted
        for _ in range(8):
            status, headers, body = post(
                server.url,
                "/observe",
                b"{}",
                {"Cookie": cookie, "Accept": BINARY_ACCEPT, "Accept-Encoding": "zstd"},
            )
            assert status == 200 and headers["content-encoding"] == "zstd"
            assert len(body) < 2000  # the 100,800-byte frame and its head
            names = {name.lower() for name in headers}
            elsewhere += bool(names & {"x-gym-forwarded-by", "x-gym-handed-over-by"})
    finally:
        remote.close()
    assert elsewhere > 0  # 8 new connections over 4 workers: all on the holder is 1 in 65,536
    assert server.stop() == 0
