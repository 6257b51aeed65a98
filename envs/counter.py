"""The stateful counter: the environment every routing test and benchmark uses.

An episode starts at ``initial_count``; each action adds an integer in
[-10, 10]; the observation is the current count. ``verify()`` scores 1.0 when
the count equals ``expected_count``. The state lives in the env instance, so a
request served by a worker that does not hold the session sees the wrong count
(or none): exactly the failure that session routing prevents.

Serve it with ``gym-sessions serve envs.counter:CounterEnv --workers 4``; its
agent server is `envs.counter_agent`.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["CounterEnv"]

_INT64 = np.iinfo(np.int64)


class CounterEnv(gym.Env[np.ndarray, np.int64]):
    """A counter: reset with ``options={"initial_count", "expected_count"}``, step by increments."""

    metadata = {"render_modes": ["ansi"], "render_fps": 4}

    def __init__(self, render_mode: str | None = None) -> None:
        self.observation_space = gym.spaces.Box(_INT64.min, _INT64.max, shape=(), dtype=np.int64)
        self.action_space = gym.spaces.Discrete(21, start=-10)
        self.render_mode = render_mode
        self.count = 0
        self.expected_count: int | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        self.count = int(options.get("initial_count", 0))
        expected = options.get("expected_count")
        self.expected_count = None if expected is None else int(expected)
        return np.array(self.count, dtype=np.int64), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.count += int(action)
        return np.array(self.count, dtype=np.int64), 0.0, False, False, {}

    def verify(self) -> dict[str, Any]:
        """Reward 1.0 iff the count equals the expected count."""
        correct = self.expected_count is not None and self.count == self.expected_count
        return {"reward": 1.0 if correct else 0.0, "count": self.count}

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return f"count={self.count}\n"
        return None
