"""Envs with Atari-sized pixel observations, to serve in tests and benchmarks.

`pong` is ALE's ``ALE/Pong-v5`` (the ``atari`` extra: ``ale-py``, ROMs
included); `PixelEnv` is a synthetic stand-in with the same spaces (210x160x3
uint8 frames, 6 actions) for machines without ``ale-py``: each step changes a
row of its frame by the action, so a changed action or frame shows; its
frames are noise, which no compression shrinks. `FlatFrames` has frames as
Atari's are, one colour and a small moving square, which compress well.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["FRAME_SHAPE", "FlatFrames", "PixelEnv", "pong"]

FRAME_SHAPE = (210, 160, 3)


def pong(**kwargs: Any) -> gym.Env:
    """``gymnasium.make("ALE/Pong-v5", **kwargs)``, registering ALE's envs first."""
    import ale_py

    gym.register_envs(ale_py)
    return gym.make("ALE/Pong-v5", **kwargs)


class PixelEnv(gym.Env):
    """Atari-shaped frames, deterministic by seed; episodes of `EPISODE_STEPS` steps."""

    EPISODE_STEPS = 500
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, FRAME_SHAPE, np.uint8)
        self.action_space = gym.spaces.Discrete(6)
        self._frame = np.zeros(FRAME_SHAPE, np.uint8)
        self._steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._frame = self.np_random.integers(0, 256, FRAME_SHAPE, dtype=np.uint8)
        self._steps = 0
        return self._frame.copy(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        row = self._steps % FRAME_SHAPE[0]
        self._frame[row] = (self._frame[row].astype(np.int64) + 37 * int(action) + 1) % 256
        reward = float(self._frame[row, 0, 0]) / 255.0
        return self._frame.copy(), reward, False, self._steps >= self.EPISODE_STEPS, {}


class FlatFrames(gym.Env):
    """Frames of one colour with an 8x8 square that moves down 4 rows a step (0 to 3 actions)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, FRAME_SHAPE, np.uint8)
        self.action_space = gym.spaces.Discrete(4)
        self.steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.steps = 0
        return self._frame(), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        return self._frame(), float(action), False, False, {}

    def _frame(self) -> np.ndarray:
        frame = np.full(FRAME_SHAPE, 90, np.uint8)
        row = 4 * self.steps % (FRAME_SHAPE[0] - 8)
        frame[row : row + 8, 20:28] = 236
        return frame
