"""`run_episodes`: K episodes of a policy across a vector of remote envs, one tidy record per step.

Each record says which episode and step it is, which sub-env and server worker
ran it, what the policy saw and did, and what came back::

    {"episode": 3, "step": 0, "env_index": 1, "worker": "4242-1a2b3c4d",
     "observation": ..., "action": ..., "reward": 1.0,
     "terminated": False, "truncated": False}

Episode ids are given in the order episodes start (sub-env order within a
step), so a run is reproducible from its seed, ``num_envs`` and a deterministic
policy. Sub-envs keep stepping until ``episodes`` episodes have ended; steps of
episodes beyond that are not recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from copy import deepcopy
from typing import Any, Protocol

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import concatenate, create_empty_array, iterate
from tqdm import tqdm

from gym_sessions._registration import REMOTE_ENV_ID
from gym_sessions.client.records import RolloutRecords
from gym_sessions.client.vector_env import sub_env_info

__all__ = ["Agent", "run_episodes"]


class Agent(Protocol):
    """A policy object: ``act(observation, info) -> action`` for one sub-env."""

    def act(self, observation: Any, info: dict[str, Any]) -> Any: ...


RolloutPolicy = Callable[[Any], Any] | Agent


def run_episodes(
    env: str | VectorEnv,
    policy: RolloutPolicy,
    *,
    episodes: int,
    num_envs: int = 1,
    seed: int | None = None,
    progress: bool = True,
    headers: Mapping[str, str] | None = None,
    **make_kwargs: Any,
) -> RolloutRecords:
    """Run ``episodes`` episodes of ``policy``; returns one record per step (module docstring).

    The records are a list (`RolloutRecords`) that also holds the env's
    single observation and action spaces, so ``records.save_jsonl(path)`` and
    ``records.to_dataframe()`` work as they are (`gym_sessions.client.records`).

    Example:
        >>> records = run_episodes(url, lambda obs: int(obs[2] > 0), episodes=20, num_envs=8)
        >>> returns = collections.Counter()
        >>> for r in records:
        ...     returns[r["episode"]] += r["reward"]

    Args:
        env: A server URL (a `RemoteVectorEnv` of ``num_envs`` sessions is made
            with ``gymnasium.make_vec`` and closed at the end), or a vector env
            (any autoreset mode; it stays open).
        policy: ``policy(observation) -> action``, or an object with
            ``act(observation, info) -> action``; called per sub-env.
        episodes: How many episodes to run.
        num_envs: Sessions stepped concurrently (with a URL).
        seed: Seeds the first reset (sub-env ``i`` gets ``seed + i``) and the
            placeholder actions of sub-envs whose steps are not recorded.
        progress: Show a tqdm progress bar of finished episodes.
        headers: Extra headers sent with every request (an authenticating
            proxy's, say), with a URL; a vector env you pass keeps its own.
        make_kwargs: More arguments for ``make_vec`` (``max_episode_steps``,
            ``timeout``, ``render_mode``, ...), with a URL.

    Raises:
        ValueError: ``episodes`` is below 1, or ``headers`` come with a vector env.
    """
    if episodes < 1:
        raise ValueError(f"episodes must be at least 1, not {episodes}")
    if isinstance(env, str):
        if headers is not None:
            make_kwargs["headers"] = headers
        vector = gym.make_vec(REMOTE_ENV_ID, num_envs=num_envs, url=env, **make_kwargs)
        try:
            return _Rollout(vector, policy, seed).run(episodes, progress)
        finally:
            vector.close()
    if headers is not None:
        raise ValueError("headers= goes with a URL; make the vector env with headers= instead")
    return _Rollout(env, policy, seed).run(episodes, progress)


def _detach(value: Any) -> Any:
    return value.copy() if isinstance(value, np.ndarray) else deepcopy(value)


class _Rollout:
    """The bookkeeping of one `run_episodes` call."""

    def __init__(self, vector: VectorEnv, policy: RolloutPolicy, seed: int | None) -> None:
        self.vector = vector
        act = getattr(policy, "act", None)
        self.act: Callable[[Any, dict[str, Any]], Any] = (
            act if callable(act) else (lambda observation, info: policy(observation))  # type: ignore[operator]
        )
        self.seed = seed
        self.mode = vector.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        # Actions for sub-envs whose steps are not recorded.
        self.idle_actions = deepcopy(vector.single_action_space)
        self.idle_actions.seed(seed)

    def _workers(self) -> list[str | None]:
        workers = getattr(self.vector.unwrapped, "workers", None)
        return list(workers) if workers is not None else [None] * self.vector.num_envs

    def run(self, episodes: int, progress: bool) -> RolloutRecords:
        vector, n = self.vector, self.vector.num_envs
        observations, infos = vector.reset(seed=self.seed)
        env_infos = [sub_env_info(infos, i) for i in range(n)]
        workers = self._workers()
        episode_of = [i if i < episodes else -1 for i in range(n)]
        started = min(n, episodes)
        step_of = [0] * n
        resetting = np.zeros(n, dtype=np.bool_)  # NEXT_STEP: the next step only resets
        records = RolloutRecords(
            observation_space=vector.single_observation_space,
            action_space=vector.single_action_space,
        )
        finished = 0
        with tqdm(total=episodes, unit="episode", disable=not progress) as bar:
            while finished < episodes:
                singles = list(iterate(vector.observation_space, observations))
                actions = [
                    self.act(singles[i], env_infos[i])
                    if episode_of[i] >= 0 and not resetting[i]
                    else self.idle_actions.sample()
                    for i in range(n)
                ]
                batch: Any = create_empty_array(vector.single_action_space, n)
                batch = concatenate(vector.single_action_space, actions, batch)
                observations, rewards, terminations, truncations, infos = vector.step(batch)
                env_infos = [sub_env_info(infos, i) for i in range(n)]
                ended = np.logical_and(np.logical_or(terminations, truncations), ~resetting)
                for i in range(n):
                    if resetting[i] or episode_of[i] < 0:
                        continue
                    records.append(
                        {
                            "episode": episode_of[i],
                            "step": step_of[i],
                            "env_index": i,
                            "worker": workers[i],
                            "observation": _detach(singles[i]),
                            "action": _detach(actions[i]),
                            "reward": float(rewards[i]),
                            "terminated": bool(terminations[i]),
                            "truncated": bool(truncations[i]),
                        }
                    )
                    step_of[i] += 1
                resetting[:] = False
                for i in np.flatnonzero(ended).tolist():
                    if episode_of[i] >= 0:
                        finished += 1
                        bar.update(1)
                    episode_of[i] = started if started < episodes else -1
                    started += int(episode_of[i] >= 0)
                    step_of[i] = 0
                if self.mode == AutoresetMode.NEXT_STEP:
                    resetting = ended
                elif self.mode == AutoresetMode.DISABLED and ended.any() and finished < episodes:
                    observations, reset_infos = vector.reset(options={"reset_mask": ended})
                    for i in np.flatnonzero(ended).tolist():
                        env_infos[i] = sub_env_info(reset_infos, i)
        return records
