"""Records of real runs to JSONL and DataFrames: `run_episodes` on CartPole, an agent's ``/run``."""

from __future__ import annotations

import asyncio

import gymnasium as gym
import numpy as np
import pytest

from envs.counter_load import client_session, make_episodes
from gym_sessions.client import RolloutRecords, load_jsonl, run_episodes, save_jsonl
from tests.test_spaces import assert_same_value

pytestmark = pytest.mark.e2e


def test_run_episodes_records_round_trip_and_make_a_dataframe(serve, tmp_path):
    server = serve("CartPole-v1", workers=2)
    records = run_episodes(
        server.url, lambda obs: int(obs[2] > 0), episodes=6, num_envs=3, seed=0, progress=False
    )
    assert isinstance(records, RolloutRecords)
    assert records.observation_space == gym.make("CartPole-v1").observation_space
    records.save_jsonl(tmp_path / "cartpole.jsonl")
    loaded = load_jsonl(tmp_path / "cartpole.jsonl")
    assert loaded.observation_space == records.observation_space
    assert loaded.action_space == records.action_space
    assert len(loaded) == len(records)
    for got, want in zip(loaded, records, strict=True):
        assert list(got) == list(want)
        for key, value in want.items():
            if key == "action":
                # The policy returned a Python int; it loads as the space's value.
                assert got[key] == value and isinstance(got[key], np.int64)
            else:
                assert_same_value(value, got[key])

    frame = loaded.to_dataframe()
    assert len(frame) == len(records) and set(frame["episode"]) == set(range(6))
    # CartPole pays 1 per step: an episode's return is its number of steps.
    returns = frame.groupby("episode")["reward"].sum()
    lengths = frame.groupby("episode")["step"].max() + 1
    assert returns.tolist() == lengths.astype(float).tolist()
    assert frame.groupby("episode")["terminated"].any().all()
    assert set(frame["worker"]) <= set(records[i]["worker"] for i in range(len(records)))
    observations = np.stack(frame["observation"])
    assert observations.shape == (len(records), 4) and observations.dtype == np.float32


def test_agent_run_results_round_trip_and_make_a_dataframe(serve, tmp_path):
    env = serve("envs.counter:CounterEnv", workers=2)
    agent = serve("envs.counter_agent:CounterAgent", "--allow-env", env.url, workers=2)

    async def run_all() -> list[dict]:
        async with client_session() as client:

            async def one(task: dict) -> dict:
                body = {"env_url": env.url, "task": task}
                async with client.post(agent.url + "/run", json=body) as reply:
                    assert reply.status == 200
                    return await reply.json()

            return await asyncio.gather(*[one(e.task) for e in make_episodes(8, seed=3)])

    results = asyncio.run(run_all())
    save_jsonl(results, tmp_path / "runs.jsonl")
    loaded = load_jsonl(tmp_path / "runs.jsonl")
    assert loaded == results
    frame = loaded.to_dataframe()
    assert list(frame.columns[:5]) == [
        "reward",
        "episode_return",
        "episode_length",
        "env_session_id",
        "verify",
    ]
    assert frame["reward"].tolist() == [1.0] * 8
    assert (frame["episode_length"] >= 3).all()
    assert frame["env_session_id"].is_unique
