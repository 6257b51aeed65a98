"""The counter env on OpenEnv's own server, for `benchmarks/openenv_peer.py` (OpenEnv's venv only).

The same episode as ``gym_sessions/Counter-v0``: reset to ``initial_count``,
each step adds an integer in [-10, 10], the observation is the count. Served
with ``uvicorn counter_app:app --workers 4`` from this directory, in the venv
benchmarks/README.md sets up (``openenv==0.10.0``); never imported by
gym-sessions itself.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class CounterAction(Action):
    """An increment of the count, in [-10, 10]."""

    delta: int = Field(..., ge=-10, le=10)


class CounterObservation(Observation):
    """The current count."""

    count: int = 0


class CounterEnvironment(Environment):
    """One counter per WebSocket session."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.count = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> CounterObservation:
        self.count = int(kwargs.get("initial_count", 0))
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return CounterObservation(count=self.count, done=False, reward=0.0)

    def step(self, action: CounterAction, **kwargs: Any) -> CounterObservation:  # type: ignore[override]
        self.count += action.delta
        self._state.step_count += 1
        return CounterObservation(count=self.count, done=False, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(
    CounterEnvironment,
    CounterAction,
    CounterObservation,
    env_name="counter",
    max_concurrent_envs=1024,
)
