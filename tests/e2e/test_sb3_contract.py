"""Stable-Baselines3's ``VecEnv`` contract on `RemoteVecEnv`, at 4 workers.

SB3's reference ``VecEnv`` is ``DummyVecEnv``: each test runs the same calls
on a `RemoteVecEnv` and on a ``DummyVecEnv`` of the same env run locally and
wants the same results, through SB3's own wrappers (``VecNormalize``,
``VecFrameStack``, ``VecVideoRecorder``). The served env is `SpaceKindsEnv` in
its SB3 variant: a Dict of Box, Discrete, MultiDiscrete and MultiBinary
observations, a Tuple action, and no declared render modes; ``VecFrameStack``
(Box and Dict of Box only) runs on CartPole-v1. One server of each per module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from tests.conftest import import_extra_or_skip

import_extra_or_skip("stable_baselines3", "sb3")

from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecEnv,
    VecFrameStack,
    VecNormalize,
    VecVideoRecorder,
)

from gym_sessions.integrations.sb3 import RemoteVecEnv  # noqa: E402
from gym_sessions.server.process import start_server  # noqa: E402
from tests.e2e.space_kinds_env import SpaceKindsEnv  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N = 4


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    target = "tests.e2e.space_kinds_env:SpaceKindsEnv"
    with start_server(target, "--env-kwargs", json.dumps({"kinds": "sb3"}), workers=4) as server:
        yield server.url


@pytest.fixture(scope="module")
def cartpole_url() -> Iterator[str]:
    with start_server("CartPole-v1", workers=4) as server:
        yield server.url


def local(n: int = N, **kwargs: Any) -> DummyVecEnv:
    return DummyVecEnv([lambda: SpaceKindsEnv("sb3", **kwargs) for _ in range(n)])


def assert_same_observations(got: Any, want: Any) -> None:
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            np.testing.assert_array_equal(got[key], want[key])
    else:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def assert_same_infos(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys(), (g, w)
        for key, value in w.items():
            if key == "terminal_observation":
                assert_same_observations(g[key], value)
            else:
                assert g[key] == value, key


def sb3_actions(venv: VecEnv, rng: np.random.Generator) -> list[tuple[Any, np.ndarray]]:
    """One Tuple action per sub-env, as a list: how SB3 hands a DummyVecEnv such actions."""
    space = venv.action_space
    assert isinstance(space, spaces.Tuple)
    return [
        (int(rng.integers(3)), rng.uniform(-1, 1, size=2).astype(np.float32))
        for _ in range(venv.num_envs)
    ]


def step_both(remote: VecEnv, dummy: VecEnv, actions: Any) -> tuple[Any, ...]:
    got, want = remote.step(actions), dummy.step(actions)
    assert_same_observations(got[0], want[0])
    assert got[1].dtype == want[1].dtype
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    assert_same_infos(got[3], want[3])
    return want


def test_spaces_seeds_and_steps_as_dummy_vec_env(url):
    remote, dummy = RemoteVecEnv(url, num_envs=N), local()
    try:
        assert remote.observation_space == dummy.observation_space
        assert remote.action_space == dummy.action_space
        assert remote.seed(3) == dummy.seed(3) == [3, 4, 5, 6]
        assert_same_observations(remote.reset(), dummy.reset())
        assert remote.reset_infos == dummy.reset_infos
        rng = np.random.default_rng(0)
        dones = 0
        for _ in range(25):
            want = step_both(remote, dummy, sb3_actions(dummy, rng))
            dones += int(want[2].sum())
            assert remote.reset_infos == dummy.reset_infos
        assert dones > 0
        assert remote.get_attr("np_random_seed") == [3, 4, 5, 6]
    finally:
        remote.close()
        dummy.close()


def test_a_wrong_number_of_actions_is_refused(url):
    remote = RemoteVecEnv(url, num_envs=N)
    try:
        remote.reset()
        with pytest.raises(ValueError):
            remote.step(sb3_actions(remote, np.random.default_rng(0))[:2])
    finally:
        remote.close()


def test_vec_normalize_as_on_dummy_vec_env(url):
    def wrap(venv: VecEnv) -> VecEnv:
        return VecNormalize(venv, norm_obs_keys=["box"], clip_obs=5.0)

    remote, dummy = wrap(RemoteVecEnv(url, num_envs=N)), wrap(local())
    try:
        remote.seed(8)
        dummy.seed(8)
        got, want = remote.reset(), dummy.reset()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6)
        rng = np.random.default_rng(1)
        for _ in range(15):
            actions = sb3_actions(dummy, rng)
            got, want = remote.step(actions), dummy.step(actions)
            for key in want[0]:
                np.testing.assert_allclose(got[0][key], want[0][key], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
            np.testing.assert_array_equal(got[2], want[2])
        np.testing.assert_allclose(remote.obs_rms["box"].mean, dummy.obs_rms["box"].mean)
    finally:
        remote.close()
        dummy.close()


def test_vec_frame_stack_as_on_dummy_vec_env(cartpole_url):
    remote = VecFrameStack(RemoteVecEnv(cartpole_url, num_envs=N, max_episode_steps=15), 3)
    dummy = VecFrameStack(
        DummyVecEnv([lambda: gym.make("CartPole-v1", max_episode_steps=15) for _ in range(N)]), 3
    )
    try:
        remote.seed(2)
        dummy.seed(2)
        np.testing.assert_array_equal(remote.reset(), dummy.reset())
        rng = np.random.default_rng(4)
        dones = 0
        for _ in range(40):
            actions = rng.integers(0, 2, size=N)
            got, want = remote.step(actions), dummy.step(actions)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[2], want[2])
            dones += int(want[2].sum())
            for g, w in zip(got[3], want[3], strict=True):
                if "terminal_observation" in w:
                    np.testing.assert_array_equal(
                        g["terminal_observation"], w["terminal_observation"]
                    )
        assert dones > 0
    finally:
        remote.close()
        dummy.close()


def test_env_method_get_attr_and_env_is_wrapped(url):
    remote = RemoteVecEnv(url, num_envs=N)
    try:
        remote.reset()
        scores = remote.env_method("verify", indices=[1, 3])
        assert [score["episode_length"] for score in scores] == [0, 0]
        assert remote.get_attr("render_mode") == [None] * N
        assert not remote.has_attr("kinds")  # the served env's attributes stay on the server
        with pytest.raises(AttributeError, match="server"):
            remote.set_attr("kinds", "all")
        with pytest.raises(AttributeError):
            remote.env_method("reset")
        assert remote.env_is_wrapped(VecNormalize) == [False] * N
    finally:
        remote.close()


def test_renders_an_env_that_declares_no_render_modes_as_dummy_vec_env(url):
    remote, dummy = (
        RemoteVecEnv(url, num_envs=2, render_mode="rgb_array"),
        local(2, render_mode="rgb_array"),
    )
    try:
        remote.seed(0)
        dummy.seed(0)
        remote.reset()
        dummy.reset()
        rng = np.random.default_rng(2)
        for _ in range(3):
            step_both(remote, dummy, sb3_actions(dummy, rng))
        np.testing.assert_array_equal(remote.render(), dummy.render())
        for got, want in zip(remote.get_images(), dummy.get_images(), strict=True):
            np.testing.assert_array_equal(got, want)
    finally:
        remote.close()
        dummy.close()


def test_vec_video_recorder_writes_a_video(url, tmp_path):
    pytest.importorskip("moviepy", reason="VecVideoRecorder needs moviepy (the dev extra)")
    venv = VecVideoRecorder(
        RemoteVecEnv(url, num_envs=2, render_mode="rgb_array"),
        str(tmp_path),
        record_video_trigger=lambda step: step == 0,
        video_length=5,
    )
    try:
        venv.reset()
        rng = np.random.default_rng(3)
        for _ in range(7):
            venv.step(sb3_actions(venv, rng))
    finally:
        venv.close()
    videos = [p for p in tmp_path.iterdir() if p.suffix == ".mp4"]
    assert len(videos) == 1 and videos[0].stat().st_size > 0, videos
