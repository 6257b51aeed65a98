"""`AsyncRemoteEnv` and `RemoteVectorEnv` against real multi-worker servers.

The vector env's autoreset semantics are checked against gymnasium's own
`SyncVectorEnv` running the same CartPole locally: with the same seeds and
actions, every observation, reward, flag and info must be identical.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import threading
import time
import urllib.request
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from gymnasium.wrappers.vector import RecordEpisodeStatistics

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv, RemoteVectorEnv
from gym_sessions.errors import GymSessionsError, SessionGoneError
from gym_sessions.server.process import start_server
from tests.services import claim_owner

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"
COUNTER = "envs.counter:CounterEnv"
CPU_COUNTER = "envs.cpu_counter:CpuCounterEnv"


@pytest.fixture(scope="module")
def counter_url():
    with start_server(COUNTER, workers=4) as server:
        yield server.url


@pytest.fixture(scope="module")
def cartpole_url():
    with start_server("CartPole-v1", workers=4) as server:
        yield server.url


def test_fifty_async_envs_on_one_loop_keep_their_own_counts(counter_url):
    async def episode(k: int) -> tuple[int, int, str]:
        async with AsyncRemoteEnv(counter_url) as env:
            observation, _ = await env.reset(options={"initial_count": 1000 * k})
            assert observation == 1000 * k
            for _ in range(k % 5 + 1):
                await asyncio.sleep(0)  # interleave with the other sessions
                observation, *_ = await env.step(k % 7 - 3)
            return k, int(observation), env.worker

    async def main() -> list[tuple[int, int, str]]:
        return await asyncio.gather(*(episode(k) for k in range(50)))

    results = asyncio.run(main())
    for k, count, worker in results:
        assert count == 1000 * k + (k % 5 + 1) * (k % 7 - 3), k
        assert worker
    assert len({worker for *_, worker in results}) >= 2  # 50 connections on 4 workers


def test_async_env_create_and_close_twice(counter_url):
    async def main() -> None:
        env = await AsyncRemoteEnv.create(counter_url)
        assert env.action_space == gym.spaces.Discrete(21, start=-10)
        await env.reset(seed=3, options={"initial_count": 5, "expected_count": 6})
        await env.step(1)
        assert (await env.verify())["reward"] == 1.0
        await env.close()
        await env.close()

    asyncio.run(main())


def test_make_vec_steps_eight_counter_sessions(counter_url):
    envs = gym.make_vec(REMOTE, num_envs=8, url=counter_url)
    try:
        assert isinstance(envs.unwrapped, RemoteVectorEnv)
        assert envs.metadata["autoreset_mode"] is AutoresetMode.NEXT_STEP
        assert envs.action_space == gym.spaces.MultiDiscrete([21] * 8, start=[-10] * 8)
        observations, infos = envs.reset(options={"initial_count": 5})
        assert observations.dtype == np.int64 and observations.tolist() == [5] * 8
        assert infos == {}
        actions = np.arange(8) - 4
        for _ in range(3):
            observations, rewards, terminations, truncations, _ = envs.step(actions)
        assert observations.tolist() == (5 + 3 * actions).tolist()
        assert rewards.dtype == np.float64 and not terminations.any() and not truncations.any()
        workers = envs.unwrapped.workers
        assert all(workers) and len(set(envs.unwrapped.session_ids)) == 8
    finally:
        envs.close()


def _three_counter_steps(url: str) -> list[int]:
    envs = gym.make_vec(REMOTE, num_envs=3, url=url)
    try:
        envs.reset(options={"initial_count": 5})
        for _ in range(3):
            observations, *_ = envs.step(np.array([1, 2, 3]))
        return observations.tolist()
    finally:
        envs.close()


def test_make_vec_runs_its_loop_in_the_calling_thread(counter_url):
    threads = threading.active_count()
    envs = gym.make_vec(REMOTE, num_envs=3, url=counter_url)
    try:
        envs.reset()
        envs.step(envs.action_space.sample())
        assert threading.active_count() == threads  # no loop thread: no switch per step
    finally:
        envs.close()
    assert envs.unwrapped._loop.loop.is_closed()


def test_make_vec_inside_a_running_event_loop_moves_its_loop_to_a_thread(counter_url):
    # A notebook cell runs inside the notebook's loop: the vector env cannot
    # run its own there, so a thread of its own runs it (and stops on close).
    threads = threading.active_count()

    async def in_a_loop() -> list[int]:
        return _three_counter_steps(counter_url)

    assert asyncio.run(in_a_loop()) == [8, 11, 14]
    assert threading.active_count() == threads
    assert _three_counter_steps(counter_url) == [8, 11, 14]


def test_counter_autoreset_modes_with_max_episode_steps(counter_url):
    def run(mode: AutoresetMode) -> list[tuple]:
        envs = gym.make_vec(
            REMOTE, num_envs=2, url=counter_url, autoreset_mode=mode, max_episode_steps=2
        )
        try:
            obs, _ = envs.reset(options={"initial_count": 10})
            out: list[tuple] = [(obs.tolist(),)]
            trunc = np.zeros(2, dtype=bool)
            for _ in range(3):
                if mode is AutoresetMode.DISABLED and trunc.all():
                    with pytest.raises(RuntimeError, match="autoreset is disabled"):
                        envs.step(np.array([1, 1]))
                    obs, _ = envs.reset(options={"reset_mask": np.array([True, True])})
                    out.append(("reset", obs.tolist()))
                obs, rew, term, trunc, info = envs.step(np.array([1, 2]))
                out.append((obs.tolist(), rew.tolist(), term.tolist(), trunc, info))
            return out
        finally:
            envs.close()

    next_step = run(AutoresetMode.NEXT_STEP)
    assert next_step[2][0] == [12, 14] and next_step[2][3].all()  # truncated at 2 steps
    assert next_step[3][:3] == ([0, 0], [0.0, 0.0], [False, False])  # the reset step
    assert not next_step[3][3].any()

    same_step = run(AutoresetMode.SAME_STEP)
    obs, _, _, truncated, info = same_step[2]
    assert obs == [0, 0] and truncated.all()  # already the next episode's first observation
    assert info["final_obs"].tolist() == [12, 14] and info["_final_obs"].all()
    assert same_step[3][0] == [1, 2]

    disabled = run(AutoresetMode.DISABLED)
    assert disabled[3] == ("reset", [0, 0])
    assert disabled[4][0] == [1, 2]


def _assert_same_reset(local, remote) -> None:
    np.testing.assert_array_equal(remote[0], local[0])
    _assert_same_infos(remote[1], local[1])


def _assert_same_step(local, remote) -> None:
    for got, want in zip(remote[:4], local[:4], strict=True):
        np.testing.assert_array_equal(got, want)
    _assert_same_infos(remote[4], local[4])


def _assert_same_infos(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, dict):
            _assert_same_infos(got[key], value)
        elif value.dtype == object:  # final_obs: one array (or None) per sub-env
            for g, w in zip(got[key], value, strict=True):
                np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_array_equal(got[key], value)


@pytest.mark.parametrize(
    "mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
)
def test_cartpole_autoreset_matches_sync_vector_env(cartpole_url, mode):
    n = 8
    local = gym.make_vec(
        "CartPole-v1", num_envs=n, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode}
    )
    remote = gym.make_vec(REMOTE, num_envs=n, url=cartpole_url, autoreset_mode=mode)
    rng = np.random.default_rng(0)
    try:
        _assert_same_reset(local.reset(seed=0), remote.reset(seed=0))
        ended_at = None
        for t in range(200):
            actions = rng.integers(0, 2, size=n)
            want, got = local.step(actions), remote.step(actions)
            _assert_same_step(want, got)
            ended = np.logical_or(got[2], got[3])
            if ended_at is not None:
                break
            if ended.any():
                ended_at, ended_mask, final = t, ended, got
                if mode is AutoresetMode.DISABLED:
                    with pytest.raises(RuntimeError):
                        remote.step(actions)
                    options = {"reset_mask": ended_mask}
                    _assert_same_reset(
                        local.reset(options=dict(options)), remote.reset(options=dict(options))
                    )
        assert ended_at is not None, "no CartPole episode ended in 200 random steps"
        i = int(np.flatnonzero(ended_mask)[0])
        _, rewards, terminations, _, _ = got
        if mode is AutoresetMode.NEXT_STEP:
            # The step after the end only resets: no reward, a fresh observation.
            assert rewards[i] == 0.0 and not terminations[i]
            assert np.all(np.abs(got[0][i]) <= 0.05)
        elif mode is AutoresetMode.SAME_STEP:
            # The ending step already returned the next episode's first observation.
            assert np.all(np.abs(final[0][i]) <= 0.05)
            x, _, theta, _ = final[4]["final_obs"][i]
            assert final[4]["_final_obs"][i] and (abs(x) > 2.4 or abs(theta) > 0.2095)
            assert rewards[i] == 1.0
        else:
            assert rewards[i] == 1.0 and not terminations[i]
    finally:
        local.close()
        remote.close()


def test_record_episode_statistics_gives_episode_returns(cartpole_url):
    n = 8
    local = RecordEpisodeStatistics(
        gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync")
    )
    remote = RecordEpisodeStatistics(gym.make_vec(REMOTE, num_envs=n, url=cartpole_url))
    rng = np.random.default_rng(1)
    try:
        local.reset(seed=7)
        remote.reset(seed=7)
        seen = 0
        while len(remote.return_queue) < 10:
            actions = rng.integers(0, 2, size=n)
            local.step(actions)
            *_, infos = remote.step(actions)
            if "episode" in infos:
                done = infos["_episode"]
                seen += int(done.sum())
                # CartPole pays 1 per step: an episode's return is its length.
                np.testing.assert_array_equal(
                    infos["episode"]["r"][done], infos["episode"]["l"][done]
                )
        assert seen == len(remote.return_queue) >= 10
        assert list(remote.return_queue) == list(local.return_queue)
        assert list(remote.length_queue) == list(local.length_queue)
    finally:
        local.close()
        remote.close()


def test_sigkilled_worker_names_the_lost_sub_env(serve):
    server = serve(COUNTER, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    envs = gym.make_vec(REMOTE, num_envs=8, url=server.url)
    try:
        envs.reset(options={"initial_count": 1})
        vector = envs.unwrapped
        owners = [claim_owner(runtime_dir, sid) for sid in vector.session_ids]
        assert owners == list(vector.workers)  # /health after reset names the claimant
        victim = owners[5]
        lost = [i for i, owner in enumerate(owners) if owner == victim]
        assert len(lost) == 2  # spread: the victim held 2 of the 8
        os.kill(int(victim.split("-")[0]), signal.SIGKILL)

        with pytest.raises(SessionGoneError) as info:
            envs.step(np.ones(8, dtype=np.int64))
        assert info.value.env_index == lost[0]
        assert f"sub-env {lost[0]} " in str(info.value)
        with pytest.raises(RuntimeError, match="reset"):
            envs.step(np.ones(8, dtype=np.int64))

        # A reset replaces exactly the lost sessions; the others keep theirs.
        before = vector.session_ids
        observations, _ = envs.reset(options={"initial_count": 2})
        assert observations.tolist() == [2] * 8
        changed = [i for i in range(8) if vector.session_ids[i] != before[i]]
        assert changed == lost
        assert victim not in vector.workers
        observations, *_ = envs.step(np.ones(8, dtype=np.int64))
        assert observations.tolist() == [3] * 8
    finally:
        envs.close()


# ----------------------------------------------------------------------------- spread over workers


def step_batches(url: str) -> float:
    """The server's count of answered ``/step_batch`` requests (``GET /metrics``)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith('gym_sessions_requests_total{route="/step_batch"')
    )


@pytest.mark.parametrize(
    ("group_size", "spread"), [(None, [2, 2, 2, 2]), (64, [8])], ids=["default", "groups-of-64"]
)
def test_make_vec_spreads_its_sessions_over_the_workers_one_batch_per_holder(
    serve, group_size, spread
):
    server = serve(COUNTER, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    envs = gym.make_vec(REMOTE, num_envs=8, url=server.url, batch_group_size=group_size)
    try:
        envs.reset()
        vector = envs.unwrapped
        holders = [claim_owner(runtime_dir, sid) for sid in vector.session_ids]
        assert sorted(Counter(holders).values()) == spread
        assert holders == list(vector.workers)
        before = step_batches(server.url)
        for _ in range(5):
            observations, *_ = envs.step(np.ones(8, dtype=np.int64))
        assert observations.tolist() == [5] * 8
        assert step_batches(server.url) - before == 5 * len(spread)  # one per holder a step
    finally:
        envs.close()


def run_until_a_worker_dies(
    envs, victim: str, steps: int, during_step: bool = False
) -> tuple[int, BaseException | None]:
    """Step ``envs`` (actions 1) ``steps`` times, killing ``victim`` a third of the way in.

    Between two steps, or (``during_step``) from another thread 1 ms into a step.
    Returns the steps that returned and the error that stopped them, if any.
    """
    done = 0
    for done in range(steps):
        if done == steps // 3:
            kill = functools.partial(os.kill, int(victim.split("-")[0]), signal.SIGKILL)
            if during_step:
                threading.Timer(0.001, kill).start()
            else:
                kill()
        try:
            envs.step(np.ones(envs.num_envs, dtype=np.int64))
        except GymSessionsError as error:  # the assertions name it if it is not the one expected
            return done, error
    return steps, None


@pytest.mark.parametrize("during_step", [False, True], ids=["between-steps", "during-a-step"])
def test_a_worker_killed_mid_run_takes_only_its_own_sub_envs(serve, during_step):
    # The CPU counter's step burns 1 ms: a kill 1 ms into a vector step lands inside it.
    server = serve(CPU_COUNTER, workers=4)
    envs = gym.make_vec(REMOTE, num_envs=8, url=server.url)
    try:
        envs.reset()
        vector = envs.unwrapped
        owners, sessions = vector.workers, vector.session_ids
        victim = owners[2]
        lost = [i for i, owner in enumerate(owners) if owner == victim]
        assert len(lost) == 2

        done, error = run_until_a_worker_dies(envs, victim, 30, during_step)
        assert isinstance(error, SessionGoneError) and error.env_index == lost[0], error
        assert done in (10, 11)

        # As documented: a full reset replaces exactly the lost sessions, on
        # the live workers; the other 6 keep their sessions and workers.
        envs.reset()
        kept = [i for i in range(8) if i not in lost]
        assert [vector.session_ids[i] == sessions[i] for i in range(8)] == [
            i in kept for i in range(8)
        ]
        assert [vector.workers[i] for i in kept] == [owners[i] for i in kept]
        assert victim not in vector.workers
        assert sorted(Counter(vector.workers).values()) == [2, 3, 3]
        for _ in range(3):
            observations, *_ = envs.step(np.ones(8, dtype=np.int64))
        assert observations.tolist() == [3] * 8
    finally:
        envs.close()


def test_a_worker_killed_mid_run_loses_no_durable_sub_env(serve):
    server = serve(COUNTER, "--durable-sessions", workers=4)
    envs = gym.make_vec(REMOTE, num_envs=8, url=server.url)
    try:
        envs.reset()
        vector = envs.unwrapped
        owners = vector.workers
        victim = owners[2]
        lost = [i for i, owner in enumerate(owners) if owner == victim]
        assert len(lost) == 2

        started = time.monotonic()
        done, error = run_until_a_worker_dies(envs, victim, 30)
        assert (done, error) == (30, None), f"{error!r} after {time.monotonic() - started:.1f} s"
        observations, *_ = envs.step(np.ones(8, dtype=np.int64))
        assert observations.tolist() == [31] * 8  # every step counted once, the lost ones too
        assert [owner for i, owner in enumerate(vector.workers) if i not in lost] == [
            owner for i, owner in enumerate(owners) if i not in lost
        ]
        assert victim not in vector.workers  # restored on live workers
    finally:
        envs.close()
