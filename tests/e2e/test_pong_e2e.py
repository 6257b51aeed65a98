"""An ALE Pong episode through `RemoteEnv` is bit-exact against the local env (the ``atari`` extra).

Same seed, same actions: every 210x160x3 frame, reward and flag of a whole
episode equal, the frames travelling as binary messages (docs/design.md §3.15).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import import_extra_or_skip

import_extra_or_skip("ale_py", "atari")

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
