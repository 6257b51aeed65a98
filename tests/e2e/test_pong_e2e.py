"""ALE Pong through the remote envs (the ``atari`` extra): bit-exact, raw and preprocessed.

Same seed, same actions: every 210x160x3 frame, reward and flag of a whole
episode equal, the frames travelling as binary messages (docs/design.md §3.15).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import import_extra_or_skip

import_extra_or_skip("ale_py", "atari")

from envs.atari import pong as atari_pong  # noqa: E402
from gym_sessions.client import load_binary, run_episodes, save_binary  # noqa: E402
from gym_sessions.client.remote_env import RemoteEnv  # noqa: E402
from gym_sessions.spaces.values import to_jsonable  # noqa: E402
from tests.e2e.pixel_envs import pong  # noqa: E402

pytestmark = pytest.mark.e2e

#: A random-play Pong episode is about 800 steps; the cap only bounds a surprise.
MAX_STEPS = 5000


def test_a_remote_pong_episode_is_bit_exact_against_local(serve):
    server = serve("tests.e2e.pixel_envs:pong")
    remote, local = RemoteEnv(server.url), pong()
    try:
        assert remote._protocol.description.binary_values
        observation, info = remote.reset(seed=2024)
        expected, expected_info = local.reset(seed=2024)
        np.testing.assert_array_equal(observation, expected)
        assert info == to_jsonable(expected_info)  # infos travel as JSON, as ever
        rng = np.random.default_rng(2024)
        steps, rewards, done = 0, 0.0, False
        while not done and steps < MAX_STEPS:
            action = int(rng.integers(local.action_space.n))
            got, want = remote.step(action), local.step(action)
            assert got[0].shape == (210, 160, 3) and got[0].dtype == np.uint8
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:4] == want[1:4] and got[4] == to_jsonable(want[4]), steps
            rewards += got[1]
            steps += 1
            done = got[2] or got[3]
        assert done and rewards < 0  # a whole episode, which random play loses
    finally:
        remote.close()
        local.close()


def test_preprocessed_pong_rollouts_save_and_load_as_raw_bytes(serve, tmp_path):
    # The usual AtariPreprocessing and a stack of 4 frames, served at 2 workers
    # (envs/atari.py); the records of a remote rollout saved with save_binary
    # and loaded bit-exact, the file about the frames' bytes, and the first
    # episode's frames those of a local env given the same seed and actions.
    kwargs = {"max_episode_steps": 40}
    server = serve("envs.atari:pong", "--env-kwargs", json.dumps(kwargs), workers=2)
    rng = np.random.default_rng(7)
    records = run_episodes(
        server.url, lambda obs: int(rng.integers(6)), episodes=3, num_envs=2, seed=7
    )
    assert {r["observation"].shape for r in records} == {(4, 84, 84)}
    path = tmp_path / "pong.records"
    save_binary(records, path)
    raw = sum(r["observation"].nbytes for r in records)
    assert raw < path.stat().st_size < raw + 512 * len(records)
    loaded = load_binary(path)
    assert len(loaded) == len(records)
    for got, want in zip(loaded, records, strict=True):
        np.testing.assert_array_equal(got["observation"], want["observation"])
        assert got["action"] == want["action"] and got["reward"] == want["reward"]
    first = [r for r in loaded if r["env_index"] == 0 and r["episode"] == loaded[0]["episode"]]
    local = atari_pong(**kwargs)
    try:
        observation, _ = local.reset(seed=7)
        for record in first:
            np.testing.assert_array_equal(record["observation"], observation)
            observation, *_ = local.step(record["action"])
    finally:
        local.close()
