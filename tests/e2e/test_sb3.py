"""`RemoteVecEnv` (the ``sb3`` extra) against real CartPole servers at 4 workers.

SB3 ships no checker for a ``VecEnv``; its reference ``VecEnv`` is
``DummyVecEnv``, so the contract test steps both on the same seeds and actions
and wants identical observations, rewards, dones, infos and reset infos, under
SB3's own ``VecCheckNan``. A seeded PPO through ``VecMonitor(RemoteVecEnv)``
must collect the same rollouts as the same PPO on a local ``DummyVecEnv``.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest

from tests.conftest import import_extra_or_skip

import_extra_or_skip("stable_baselines3", "sb3")

import torch  # noqa: E402  (the extra's: imported once it is known to be there)
from stable_baselines3 import PPO  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.utils import check_for_correct_spaces  # noqa: E402
from stable_baselines3.common.vec_env import (  # noqa: E402
    DummyVecEnv,
    VecCheckNan,
    VecEnv,
    VecMonitor,
)

from gym_sessions.integrations.sb3 import RemoteVecEnv  # noqa: E402
from gym_sessions.server.process import start_server  # noqa: E402
from tests.stress.scenarios import worker_healths  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N = 4


@pytest.fixture(scope="module")
def cartpole_url() -> Iterator[str]:
    with start_server("CartPole-v1", workers=4) as server:
        yield server.url


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # Two cores shared by several test runs; one thread also keeps PPO's CPU maths
    # in one fixed order, so two seeded runs compute the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def sb3_logs_in_tmp_path(tmp_path, monkeypatch) -> None:
    # PPO.learn makes a log directory even at verbose=0 (tempdir/SB3-<time> by
    # default): keep it in this test's own directory, not /tmp.
    monkeypatch.setenv("SB3_LOGDIR", str(tmp_path / "sb3-logs"))


def local_cartpoles(n: int = N, **make_kwargs) -> DummyVecEnv:
    return DummyVecEnv([lambda: gym.make("CartPole-v1", **make_kwargs) for _ in range(n)])


def assert_same_infos(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert sorted(g) == sorted(w), (g, w)
        for key, value in w.items():
            np.testing.assert_array_equal(g[key], value)


def test_steps_exactly_as_dummy_vec_env(cartpole_url):
    # max_episode_steps=20 (counted by the client, a TimeLimit locally) so that
    # random play ends episodes both ways: terminated and truncated.
    remote = VecCheckNan(RemoteVecEnv(cartpole_url, num_envs=N, max_episode_steps=20))
    local = local_cartpoles(max_episode_steps=20)
    try:
        assert isinstance(remote.unwrapped, VecEnv) and remote.num_envs == N
        check_for_correct_spaces(remote, local.observation_space, local.action_space)
        assert remote.seed(7) == local.seed(7) == [7, 8, 9, 10]
        np.testing.assert_array_equal(remote.reset(), local.reset())
        assert remote.unwrapped.reset_infos == local.reset_infos
        rng = np.random.default_rng(0)
        ends = {"terminated": 0, "truncated": 0}
        for _ in range(150):
            actions = rng.integers(0, 2, size=N)
            got, want = remote.step(actions), local.step(actions)
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1].dtype == want[1].dtype == np.float32
            np.testing.assert_array_equal(got[1], want[1])
            np.testing.assert_array_equal(got[2], want[2])
            assert_same_infos(got[3], want[3])
            assert_same_infos(remote.unwrapped.reset_infos, local.reset_infos)
            for info in got[3]:
                if "terminal_observation" in info:
                    ends["truncated" if info["TimeLimit.truncated"] else "terminated"] += 1
        assert ends["terminated"] > 0 and ends["truncated"] > 0, ends
        # Without seed() the next reset is unseeded on both sides: the envs' RNGs go on.
        np.testing.assert_array_equal(remote.reset(), local.reset())
    finally:
        remote.close()
        local.close()


class RolloutRecorder(BaseCallback):
    """Keeps a copy of every rollout PPO collects (the buffer is refilled each time)."""

    def __init__(self) -> None:
        super().__init__()
        self.rollouts: list[dict[str, np.ndarray]] = []

    def _on_step(self) -> bool:
        return True

    def _on_rollout_end(self) -> None:
        buffer = self.model.rollout_buffer
        self.rollouts.append(
            {
                name: getattr(buffer, name).copy()
                for name in ("observations", "actions", "rewards", "episode_starts")
            }
        )


def train(env: VecEnv, timesteps: int) -> tuple[PPO, RolloutRecorder]:
    recorder = RolloutRecorder()
    model = PPO(
        "MlpPolicy", env, n_steps=64, batch_size=64, n_epochs=2, seed=0, device="cpu", verbose=0
    )
    model.learn(total_timesteps=timesteps, callback=recorder)
    return model, recorder


def test_seeded_ppo_collects_the_same_rollouts_as_on_local_envs(cartpole_url):
    remote = VecMonitor(RemoteVecEnv(cartpole_url, num_envs=N))
    local = VecMonitor(local_cartpoles())
    try:
        remote_model, remote_rollouts = train(remote, 1_024)  # 4 rollouts of 64 x 4 steps
        local_model, local_rollouts = train(local, 1_024)
        assert len(remote_rollouts.rollouts) == len(local_rollouts.rollouts) == 4
        # Observations come from seeded envs, actions from the seeded policy on them,
        # then training on the same data: every rollout is the same, not only the first.
        for got, want in zip(remote_rollouts.rollouts, local_rollouts.rollouts, strict=True):
            for name, value in want.items():
                np.testing.assert_array_equal(got[name], value, err_msg=name)
        # VecMonitor's episodes reached PPO's ep_info_buffer; only the wall time differs.
        assert len(remote_model.ep_info_buffer) > 10
        episodes = [(e["r"], e["l"]) for e in remote_model.ep_info_buffer]
        assert episodes == [(e["r"], e["l"]) for e in local_model.ep_info_buffer]
        # SB3's evaluation reads VecMonitor's episodes (env_is_wrapped says no Monitor).
        got = evaluate_policy(remote_model, remote, n_eval_episodes=4, warn=False)
        want = evaluate_policy(local_model, local, n_eval_episodes=4, warn=False)
        assert got == want
    finally:
        remote.close()
        local.close()


def test_sessions_spread_over_the_workers_and_close_frees_every_one(serve):
    server = serve("CartPole-v1", workers=4)
    env = VecMonitor(RemoteVecEnv(server.url, num_envs=8))
    env.seed(0)
    env.reset()
    env.step(np.zeros(8, dtype=np.int64))
    healths = asyncio.run(worker_healths(server, 4))
    assert [h["open_sessions"] for h in healths.values()] == [2, 2, 2, 2]  # counted by holder
    env.close()
    healths = asyncio.run(worker_healths(server, 4))
    assert len(healths) == 4
    assert sum(h["open_sessions"] for h in healths.values()) == 0


def test_render_tiles_the_remote_frames(cartpole_url):
    remote = RemoteVecEnv(cartpole_url, num_envs=N, render_mode="rgb_array")
    local = DummyVecEnv(
        [lambda: gym.make("CartPole-v1", render_mode="rgb_array") for _ in range(N)]
    )
    try:
        assert remote.render_mode == "rgb_array"
        assert remote.metadata["render_fps"] == local.metadata["render_fps"]
        remote.seed(3)
        local.seed(3)
        remote.reset()
        local.reset()
        frames = remote.get_images()
        assert len(frames) == N and frames[0].shape == (400, 600, 3)
        assert frames[0].dtype == np.uint8
        for got, want in zip(frames, local.get_images(), strict=True):
            np.testing.assert_array_equal(got, want)
        tiled = remote.render()
        assert tiled.shape == (800, 1200, 3)
        np.testing.assert_array_equal(tiled, local.render())
        np.testing.assert_array_equal(remote.render("rgb_array"), tiled)
    finally:
        remote.close()
        local.close()


def test_without_a_render_mode_render_warns_and_returns_nothing(cartpole_url):
    env = RemoteVecEnv(cartpole_url, num_envs=2)
    try:
        env.reset()
        with pytest.warns(UserWarning, match="no `render_mode`"):
            assert env.render() is None
        with pytest.warns(UserWarning, match="get_images needs"):
            assert env.get_images() == [None, None]
    finally:
        env.close()


def test_attributes_and_methods_reach_the_proxies_or_say_why_not(cartpole_url):
    env = RemoteVecEnv(cartpole_url, num_envs=N)
    try:
        env.seed(0)
        env.reset()
        assert env.get_attr("render_mode") == [None] * N
        assert env.get_attr("worker") == list(env.workers) and all(env.workers)
        assert env.get_attr("session_id", indices=2) == [env.session_ids[2]]
        assert env.has_attr("metadata") and not env.has_attr("gravity")
        with pytest.raises(AttributeError, match="live on the server"):
            env.get_attr("gravity")
        with pytest.raises(AttributeError, match="--env-kwargs"):
            env.set_attr("gravity", 1.0)
        with pytest.raises(AttributeError, match="cannot call 'reset'"):
            env.env_method("reset")
        for _ in range(3):
            env.step(np.ones(N, dtype=np.int64))
        # CartPole pays 1 per step: /verify of the open episode scores 3.
        (verified,) = env.env_method("verify", indices=[1])
        assert verified["reward"] == 3.0
        assert env.env_method("render") == [None] * N  # no render mode: nothing to show
        assert env.env_is_wrapped(Monitor) == [False] * N
        assert env.env_is_wrapped(gym.wrappers.TimeLimit, indices=[0, 3]) == [False, False]
        with pytest.raises(ValueError, match="same reset options"):
            env.set_options([{"a": 1}] + [{}] * (N - 1))
        env.set_options([{}] * N)  # the same for all: fine
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # VecMonitor finds no Monitor to warn about
            VecMonitor(env)
    finally:
        env.close()
    with pytest.raises(TypeError, match="autoreset_mode"):
        RemoteVecEnv(cartpole_url, num_envs=1, autoreset_mode="NextStep")
