"""The counter whose steps take a while (``options: {"step_seconds": s}``): requests in flight.

With ``options: {"step_marker": path}`` each step creates that file before it
sleeps, so a test knows a step is running without guessing how long to wait.
"""

from __future__ import annotations

import time
from typing import Any

from envs.counter import CounterEnv


class SlowCounterEnv(CounterEnv):
    """`CounterEnv` whose ``step`` sleeps ``step_seconds`` first (blocking, like a real env)."""

    step_seconds = 0.0
    step_marker: str | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.step_seconds = float((options or {}).get("step_seconds", 0.0))
        self.step_marker = (options or {}).get("step_marker")
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        if self.step_marker is not None:
            with open(self.step_marker, "w"):
                pass
        time.sleep(self.step_seconds)
        return super().step(action)
