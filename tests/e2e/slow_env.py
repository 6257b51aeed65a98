"""The counter whose steps take a while (``options: {"step_seconds": s}``): requests in flight."""

from __future__ import annotations

import time
from typing import Any

from envs.counter import CounterEnv


class SlowCounterEnv(CounterEnv):
    """`CounterEnv` whose ``step`` sleeps ``step_seconds`` first (blocking, like a real env)."""

    step_seconds = 0.0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.step_seconds = float((options or {}).get("step_seconds", 0.0))
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        time.sleep(self.step_seconds)
        return super().step(action)
