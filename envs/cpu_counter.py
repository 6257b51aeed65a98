"""The counter with a CPU-heavy step: each step burns about 1 ms of CPU, then counts.

For benchmarks of how workers scale when the environment, not the HTTP plumbing,
is the work. The burn is measured in this thread's CPU time, so a step costs
the same CPU however busy the machine is (its wall time grows when it waits
for a core).

Serve it with ``gym-sessions serve envs.cpu_counter:CpuCounterEnv --workers 4``.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .counter import CounterEnv

__all__ = ["STEP_CPU_SECONDS", "CpuCounterEnv"]

STEP_CPU_SECONDS = 0.001


class CpuCounterEnv(CounterEnv):
    """`CounterEnv` whose ``step`` first spins for ``STEP_CPU_SECONDS`` of thread CPU time."""

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        deadline = time.thread_time() + STEP_CPU_SECONDS
        while time.thread_time() < deadline:
            pass
        return super().step(action)
