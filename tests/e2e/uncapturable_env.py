"""A counter holding a lock: no ``get_state`` and pickle refuses it, so it is not durable."""

from __future__ import annotations

import threading

from envs.counter import CounterEnv


class LockedCounterEnv(CounterEnv):
    """`CounterEnv` with a `threading.Lock` attribute (locks do not pickle)."""

    def __init__(self, render_mode: str | None = None) -> None:
        super().__init__(render_mode)
        self.lock = threading.Lock()
