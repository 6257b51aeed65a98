"""Gymnasium's own contracts on the remote env and vector env, at 4 workers.

Written from Gymnasium's documented API (``VectorEnv``, ``SyncVectorEnv``,
``make``/``make_vec``, the core wrappers): each test runs the same thing on a
remote env and on the same env run locally, and wants the same results
(``data_equivalence``: values and types), or the documented error. Servers are
shared per module: one CartPole-v1, one FrozenLake-v1 (a Discrete observation
the env returns as a Python ``int``) and one `SpaceKindsEnv` (every space kind
of the codec), 4 workers each.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import data_equivalence
from gymnasium.vector import AutoresetMode, SyncVectorEnv

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.server.process import start_server
from tests.e2e.space_kinds_env import SpaceKindsEnv

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"
N = 4
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]


@pytest.fixture(scope="module")
def cartpole_url() -> Iterator[str]:
    with start_server("CartPole-v1", workers=4) as server:
        yield server.url


@pytest.fixture(scope="module")
def frozen_lake_url() -> Iterator[str]:
    with start_server("FrozenLake-v1", workers=4) as server:
        yield server.url


@pytest.fixture(scope="module")
def kinds_url() -> Iterator[str]:
    with start_server("tests.e2e.space_kinds_env:SpaceKindsEnv", workers=4) as server:
        yield server.url


def local_cartpoles(n: int = N, **kwargs: Any) -> SyncVectorEnv:
    return SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n)], **kwargs)


def assert_same(got: Any, want: Any) -> None:
    assert data_equivalence(got, want), (got, want)


def step_both(remote: gym.vector.VectorEnv, local: gym.vector.VectorEnv, actions: Any) -> Any:
    got, want = remote.step(actions), local.step(actions)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    return want


# The remote env: spec and wrappers --------------------------------------------------------


def test_spec_carries_the_served_envs_episode_limits(cartpole_url):
    env = gym.make(REMOTE, url=cartpole_url)
    envs = gym.make_vec(REMOTE, num_envs=2, url=cartpole_url)
    try:
        local = gym.spec("CartPole-v1")
        for spec in (env.spec, envs.spec):
            assert spec is not None and spec.id == REMOTE
            assert spec.max_episode_steps == local.max_episode_steps == 500
            assert spec.reward_threshold == local.reward_threshold == 475.0
        # A limit the caller gives wins (gymnasium.make adds its TimeLimit).
        limited = gym.make(REMOTE, url=cartpole_url, max_episode_steps=7)
        assert limited.spec.max_episode_steps == 7
        limited.close()
    finally:
        env.close()
        envs.close()


def wrapped_pair(cartpole_url: str, wrap: Any) -> tuple[gym.Env, gym.Env]:
    return wrap(gym.make(REMOTE, url=cartpole_url)), wrap(gym.make("CartPole-v1"))


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(lambda env: gym.wrappers.TimeLimit(env, 9), id="TimeLimit"),
        pytest.param(gym.wrappers.TimeAwareObservation, id="TimeAwareObservation"),
        pytest.param(gym.wrappers.RecordEpisodeStatistics, id="RecordEpisodeStatistics"),
        pytest.param(gym.wrappers.NormalizeObservation, id="NormalizeObservation"),
        pytest.param(lambda env: gym.wrappers.FrameStackObservation(env, 3), id="FrameStack"),
    ],
)
def test_core_wrappers_give_what_they_give_locally(cartpole_url, wrap):
    remote, local = wrapped_pair(cartpole_url, wrap)
    try:
        assert remote.observation_space == local.observation_space
        assert_same(remote.reset(seed=5), local.reset(seed=5))
        rng = np.random.default_rng(1)
        episodes = 0
        for _ in range(150):
            action = int(rng.integers(2))
            got, want = remote.step(action), local.step(action)
            for g, w in zip(got[:4], want[:4], strict=True):
                np.testing.assert_allclose(np.asarray(g, float), np.asarray(w, float), 1e-6)
            # RecordEpisodeStatistics' "episode" holds wall-clock times ("t"): skip those.
            assert got[4].keys() == want[4].keys()
            if "episode" in want[4]:
                assert got[4]["episode"]["r"] == want[4]["episode"]["r"]
                assert got[4]["episode"]["l"] == want[4]["episode"]["l"]
            if got[2] or got[3]:
                episodes += 1
                assert_same(remote.reset(seed=episodes), local.reset(seed=episodes))
        assert episodes > 0
    finally:
        remote.close()
        local.close()


def test_record_video_writes_the_episode(cartpole_url, tmp_path):
    pytest.importorskip("moviepy", reason="RecordVideo needs moviepy (the dev extra)")
    env = gym.wrappers.RecordVideo(
        gym.make(REMOTE, url=cartpole_url, render_mode="rgb_array"),
        str(tmp_path),
        episode_trigger=lambda episode: True,
        disable_logger=True,
    )
    try:
        env.reset(seed=0)
        for _ in range(5):
            env.step(0)
        env.reset(seed=1)  # ends the first video
    finally:
        env.close()
    videos = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".mp4")
    assert videos and videos[0].endswith("episode-0.mp4"), videos
    assert os.path.getsize(tmp_path / videos[0]) > 0


# The vector env: seeding, resets, autoreset ----------------------------------------------


def test_seeding_as_sync_vector_env(cartpole_url):
    remote = gym.make_vec(REMOTE, num_envs=N, url=cartpole_url)
    local = local_cartpoles()
    try:
        assert len(remote.np_random_seed) == N  # random seeds before any reset, as Sync's
        assert_same(remote.reset(seed=42), local.reset(seed=42))
        assert remote.np_random_seed == local.np_random_seed == (42, 43, 44, 45)
        assert all(isinstance(g, np.random.Generator) for g in remote.np_random)
        seeds = [3, None, 5, None]
        remote_obs, _ = remote.reset(seed=seeds)
        local_obs, _ = local.reset(seed=seeds)
        for i in (0, 2):
            assert_same(remote_obs[i], local_obs[i])
        assert remote.np_random_seed[0] == 3 and remote.np_random_seed[2] == 5
        with pytest.raises(ValueError, match="num_envs"):
            remote.reset(seed=[1, 2])
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
def test_autoreset_and_reset_mask_as_sync_vector_env(cartpole_url, mode):
    remote = gym.make_vec(
        REMOTE, num_envs=N, url=cartpole_url, autoreset_mode=mode, max_episode_steps=12
    )
    local = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=12) for _ in range(N)],
        autoreset_mode=mode,
    )
    try:
        assert remote.metadata["autoreset_mode"] == mode
        assert_same(remote.reset(seed=7), local.reset(seed=7))
        rng = np.random.default_rng(2)
        ended = 0
        for _ in range(40):
            want = step_both(remote, local, rng.integers(0, 2, size=N))
            done = np.logical_or(want[2], want[3])
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                with pytest.raises(RuntimeError, match="reset_mask"):
                    remote.step(np.zeros(N, dtype=np.int64))
                mask = done.copy()
                assert_same(
                    remote.reset(options={"reset_mask": mask}),
                    local.reset(options={"reset_mask": mask}),
                )
        assert ended > 0
        # A partial reset in any mode: only the masked sub-envs restart.
        mask = np.array([True, False, True, False])
        assert_same(
            remote.reset(seed=[1, None, 2, None], options={"reset_mask": mask}),
            local.reset(seed=[1, None, 2, None], options={"reset_mask": mask}),
        )
        for bad, error in [
            (np.array([1, 0, 1, 0]), TypeError),
            (np.zeros(N, dtype=bool), ValueError),
            (np.ones(N + 1, dtype=bool), ValueError),
        ]:
            with pytest.raises(error):
                remote.reset(options={"reset_mask": bad})
    finally:
        remote.close()
        local.close()


def test_a_wrong_number_of_actions_is_a_value_error_and_nothing_steps(cartpole_url):
    envs = gym.make_vec(REMOTE, num_envs=N, url=cartpole_url)
    try:
        envs.reset(seed=0)
        for actions in (np.array([0, 1]), np.array([0, 1, 0, 1, 0]), np.zeros((N, 2), int)):
            with pytest.raises(ValueError):
                envs.step(actions)
        with pytest.raises(ValueError, match="sub-env 2") as raised:
            envs.step(np.array([0, 1, 5, 1]))
        assert raised.value.env_index == 2
        # Nothing was sent: the vector env steps on without a reset, all at step 1.
        envs.step(np.array([0, 1, 0, 1]))
        lengths = envs.unwrapped.call("verify")
        assert [result["episode_length"] for result in lengths] == [1] * N
    finally:
        envs.close()


def test_infos_merge_as_sync_vector_env(kinds_url):
    remote = gym.make_vec(REMOTE, num_envs=N, url=kinds_url, autoreset_mode="SameStep")
    local = SyncVectorEnv([SpaceKindsEnv for _ in range(N)], autoreset_mode="SameStep")
    try:
        _, remote_info = remote.reset(seed=3)
        _, local_info = local.reset(seed=3)
        assert_same(remote_info, local_info)
        assert set(remote_info) == {"steps", "_steps"}
    finally:
        remote.close()
        local.close()


def test_call_get_attr_set_attr(cartpole_url):
    envs = gym.make_vec(REMOTE, num_envs=N, url=cartpole_url)
    try:
        envs.reset(seed=0)
        assert envs.get_attr("url") == (cartpole_url,) * N
        assert envs.call("verify")[0]["episode_length"] == 0
        spaces = envs.get_attr("action_space")
        assert all(space == gym.spaces.Discrete(2) for space in spaces)
        # The served env's own attributes stay on the server: say so.
        for read in (lambda: envs.get_attr("gravity"), lambda: envs.call("gravity")):
            with pytest.raises(AttributeError, match="live on the server"):
                read()
        with pytest.raises(AttributeError, match="served env lives on the server"):
            envs.unwrapped.set_attr("gravity", [1.0] * N)
    finally:
        envs.close()


@pytest.mark.parametrize("mode", ["rgb_array", "rgb_array_list"])
def test_render_modes_as_sync_vector_env(cartpole_url, mode):
    remote = gym.make_vec(REMOTE, num_envs=2, url=cartpole_url, render_mode=mode)
    local = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync", render_mode=mode)
    try:
        assert remote.render_mode == local.render_mode == mode
        assert_same(remote.reset(seed=0), local.reset(seed=0))
        for _ in range(3):
            step_both(remote, local, np.array([1, 0]))
        assert_same(remote.render(), local.render())
        if mode.endswith("_list"):
            assert len(remote.render()[0]) == 0  # render() empties the lists
    finally:
        remote.close()
        local.close()


@pytest.mark.parametrize("vectorization_mode", ["sync", "async"])
def test_vector_kwargs_with_gymnasiums_own_vector_envs(cartpole_url, vectorization_mode):
    # Gymnasium refuses vector_kwargs for every env with a vector entry point
    # (CartPole-v1 too); with the sync or async mode they reach its vector env.
    envs = gym.make_vec(
        REMOTE,
        num_envs=2,
        url=cartpole_url,
        vectorization_mode=vectorization_mode,
        vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP},
    )
    try:
        assert envs.metadata["autoreset_mode"] == AutoresetMode.SAME_STEP
        local = local_cartpoles(2, autoreset_mode=AutoresetMode.SAME_STEP)
        assert_same(envs.reset(seed=1), local.reset(seed=1))
        for _ in range(30):
            step_both(envs, local, np.array([1, 1]))
        local.close()
    finally:
        envs.close()


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
def test_python_int_observations_stay_python_ints(frozen_lake_url, mode):
    # FrozenLake returns int states; SAME_STEP's final_obs holds them as they were.
    remote = gym.make_vec(REMOTE, num_envs=N, url=frozen_lake_url, autoreset_mode=mode)
    local = SyncVectorEnv(
        [lambda: gym.make("FrozenLake-v1") for _ in range(N)], autoreset_mode=mode
    )
    single = gym.make(REMOTE, url=frozen_lake_url)
    try:
        observation, _ = single.reset(seed=0)
        assert type(observation) is int
        assert_same(remote.reset(seed=5), local.reset(seed=5))
        rng = np.random.default_rng(6)
        ended = 0
        for _ in range(40):
            want = step_both(remote, local, rng.integers(0, 4, size=N))
            done = np.logical_or(want[2], want[3])
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                mask = done.copy()
                assert_same(
                    remote.reset(options={"reset_mask": mask}),
                    local.reset(options={"reset_mask": mask}),
                )
        assert ended > 0
    finally:
        single.close()
        remote.close()
        local.close()


# Every space kind of the codec ------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=lambda mode: mode.name)
def test_every_space_kind_steps_as_sync_vector_env(kinds_url, mode):
    remote = gym.make_vec(REMOTE, num_envs=N, url=kinds_url, autoreset_mode=mode)
    local = SyncVectorEnv([SpaceKindsEnv for _ in range(N)], autoreset_mode=mode)
    try:
        assert remote.single_observation_space == local.single_observation_space
        assert remote.single_action_space == local.single_action_space
        assert_same(remote.reset(seed=11), local.reset(seed=11))
        local.action_space.seed(4)
        ended = 0
        for _ in range(20):
            want = step_both(remote, local, local.action_space.sample())
            done = np.logical_or(want[2], want[3])
            ended += int(done.sum())
            if mode == AutoresetMode.DISABLED and done.any():
                mask = done.copy()
                assert_same(
                    remote.reset(options={"reset_mask": mask}),
                    local.reset(options={"reset_mask": mask}),
                )
        assert ended > 0
    finally:
        remote.close()
        local.close()
