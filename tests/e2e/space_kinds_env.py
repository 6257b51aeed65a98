"""An env whose observations and actions hold every kind of space the codec carries.

The conformance tests serve it and step it beside the same env run locally
(``SyncVectorEnv``, ``DummyVecEnv``): every value crosses the wire both ways,
so a value the codec changes shows up as a difference. Observations are
samples of the observation space drawn from the env's seeded ``np_random``;
the reward is a checksum of the action as it arrived, so an action changed on
the way changes the reward. Episodes end at random (terminated) or after
`EPISODE_STEPS` steps (truncated).

It declares no render modes (no ``metadata["render_modes"]``), yet renders
``rgb_array`` frames when made with that mode, as ``gymnasium.make`` allows.

``kinds="sb3"`` keeps to the spaces Stable-Baselines3 takes: a Dict of Box,
Discrete, MultiDiscrete and MultiBinary observations, and a Tuple action.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.spaces import (
    Box,
    Dict,
    Discrete,
    Graph,
    MultiBinary,
    MultiDiscrete,
    OneOf,
    Sequence,
    Text,
    Tuple,
)

from gym_sessions.spaces import value_to_json

__all__ = ["EPISODE_STEPS", "SpaceKindsEnv", "spaces_of"]

#: Steps after which an episode is truncated.
EPISODE_STEPS = 6


def spaces_of(kinds: str) -> tuple[gym.Space[Any], gym.Space[Any]]:
    """The (observation, action) spaces of ``kinds``: ``"all"`` or ``"sb3"``."""
    if kinds == "sb3":
        observation = Dict(
            box=Box(-2.0, 2.0, shape=(3,), dtype=np.float32),
            discrete=Discrete(5, start=-2),
            multi_discrete=MultiDiscrete([3, 4]),
            multi_binary=MultiBinary(3),
        )
        action = Tuple([Discrete(3), Box(-1.0, 1.0, shape=(2,), dtype=np.float32)])
        return observation, action
    if kinds != "all":
        raise ValueError(f"kinds must be 'all' or 'sb3', not {kinds!r}")
    every = Dict(
        box=Box(-1.0, 1.0, shape=(2, 2), dtype=np.float32),
        box_int=Box(-5, 5, shape=(3,), dtype=np.int16),
        box_bool=Box(0, 1, shape=(2,), dtype=np.bool_),
        discrete=Discrete(4, start=1),
        multi_discrete=MultiDiscrete([2, 3]),
        multi_binary=MultiBinary(4),
        text=Text(5),
        tuple=Tuple([Discrete(2), Box(0.0, 1.0, shape=(1,), dtype=np.float64)]),
        dict=Dict(inner=Discrete(3), flag=MultiBinary(1)),
        sequence=Sequence(Box(-1.0, 1.0, shape=(2,), dtype=np.float32)),
        sequence_stacked=Sequence(Discrete(3), stack=True),
        graph=Graph(
            node_space=Box(-1.0, 1.0, shape=(2,), dtype=np.float32), edge_space=Discrete(3)
        ),
        one_of=OneOf([Discrete(2), Box(-1.0, 1.0, shape=(2,), dtype=np.float32)]),
    )
    return every, every


class SpaceKindsEnv(gym.Env[Any, Any]):
    """Samples of every space kind; see the module."""

    metadata: dict[str, Any] = {"render_fps": 4}

    def __init__(self, kinds: str = "all", render_mode: str | None = None) -> None:
        self.observation_space, self.action_space = spaces_of(kinds)
        self.render_mode = render_mode
        self._steps = 0

    def render(self) -> np.ndarray | None:
        """An 8x8 frame whose shade counts the episode's steps (``rgb_array`` only)."""
        if self.render_mode != "rgb_array":
            return None
        return np.full((8, 8, 3), 30 * self._steps, dtype=np.uint8)

    def _observation(self) -> Any:
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self.observation_space.sample()

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self._steps = 0
        return self._observation(), {"steps": 0}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        assert self.action_space.contains(action), action
        self._steps += 1
        encoded = json.dumps(value_to_json(self.action_space, action), sort_keys=True)
        reward = zlib.crc32(encoded.encode()) % 1000 / 10.0
        terminated = bool(self.np_random.random() < 0.15)
        truncated = self._steps >= EPISODE_STEPS
        return self._observation(), reward, terminated, truncated, {"steps": self._steps}
