"""The stateful counter: the environment every routing test and benchmark uses.

An episode starts at ``initial_count``; each action adds an integer in
[-10, 10]; the observation is the current count. ``verify()`` scores 1.0 when
the count equals ``expected_count``. The state lives in the env instance, so a
request served by a worker that does not hold the session sees the wrong count
(or none): exactly the failure that session routing prevents.

Serve it with ``gym-sessions serve envs.counter:CounterEnv --workers 4``.
"""

from __future__ import annotations

import json
from typing import Any

import gymnasium as gym
import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from gym_sessions import InvalidRequestError, NotFoundError
from gym_sessions.server import (
    AgentServer,
    BodySchema,
    ChatCompletionsPolicy,
    Field,
    Policy,
    ScriptedPolicy,
    StopEpisode,
    integer_list,
    read_json,
)
from gym_sessions.spaces import space_from_json, space_json_schema

__all__ = ["CounterAgent", "CounterEnv"]

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


class CounterAgent(AgentServer):
    """The counter task's agent: ``/run`` plays a task, agent sessions keep a memory.

    ``/run`` takes ``{env_url, task: {initial_count, increments, expected_count}}``
    and steps each increment in order; with ``model: {base_url, name}`` it asks
    an OpenAI-compatible model for each increment instead (the task is in the
    prompt). ``env_url`` and ``base_url`` name servers the agent was started
    with (``--allow-env``, ``--allow-model``), by name or exact URL. Agent
    sessions hold a list of remembered values: ``POST /remember {value}``
    appends one and answers the count and total; the close receipt carries them.

    Serve it with ``gym-sessions serve envs.counter:CounterAgent --workers 4
    --allow-env http://127.0.0.1:8000`` (the counter env's URL).
    Its sessions' state (a list) pickles: with ``--durable-sessions`` they
    outlive their worker.
    """

    durable_agent_state = True

    def check_run(self, body: dict[str, Any]) -> None:
        TASK_BODY.validate(body.get("task"))
        if not integer_list((body.get("task") or {}).get("increments", [])):
            raise InvalidRequestError("task.increments must be a list of integers")
        if body.get("model") is not None:
            MODEL_BODY.validate(body["model"])
            self.model_url(body["model"]["base_url"])  # refused before the episode starts

    def start_body(self, body: dict[str, Any]) -> dict[str, Any]:
        task = body.get("task") or {}
        options = {
            "initial_count": task.get("initial_count", 0),
            "expected_count": task.get("expected_count"),
        }
        return {"seed": body.get("seed"), "options": options}

    def make_policy(self, body: dict[str, Any], spaces: dict[str, Any]) -> Policy:
        task = body.get("task") or {}
        increments = task.get("increments", [])
        model = body.get("model")
        if model is None:
            return ScriptedPolicy(increments)
        prompt = json.dumps({"goal": "add each increment to the counter, in order", "task": task})
        return CountedChatPolicy(
            ChatCompletionsPolicy(
                self.http_client(),
                self.model_url(model["base_url"]),
                model.get("name", "counter-model"),
                space_json_schema(space_from_json(spaces["action_space"])),
                prompt,
            ),
            len(increments),
        )

    async def seed_agent_session(self, session_id: str, body: dict[str, Any]) -> Any:
        values = body.get("values", [])
        if not integer_list(values):
            raise InvalidRequestError("values must be a list of integers")
        return {"values": list(values)}

    async def close_agent_session(self, session_id: str, state: Any) -> dict[str, Any]:
        return {"count": len(state["values"]), "total": sum(state["values"])}

    def extra_routes(self) -> list[BaseRoute]:
        return [Route("/remember", self._remember, methods=["POST"])]

    async def _remember(self, request: Request) -> JSONResponse:
        body = REMEMBER_BODY.validate(await read_json(request))
        state = self.agent_state(request)
        if state is None:
            raise NotFoundError("no agent session: seed one with POST /v1/agent_sessions")
        state["values"].append(body["value"])
        self.session_changed(self.session_id(request))  # written before the reply
        return JSONResponse({"count": len(state["values"]), "total": sum(state["values"])})


REMEMBER_BODY = BodySchema({"value": Field(("integer",), required=True)})
TASK_BODY = BodySchema(
    {
        "initial_count": Field(("integer",)),
        "increments": Field(("array",)),
        "expected_count": Field(("integer", "null")),
    }
)
MODEL_BODY = BodySchema(
    {
        "base_url": Field(
            ("string",),
            required=True,
            description="a model server the agent was started with (--allow-model): name or URL",
        ),
        "name": Field(("string",)),
    }
)


class CountedChatPolicy:
    """Asks the model for exactly ``steps`` actions, then ends the episode."""

    def __init__(self, policy: ChatCompletionsPolicy, steps: int) -> None:
        self._policy = policy
        self._left = steps

    async def act(self, observation: Any, info: dict[str, Any]) -> Any:
        if self._left <= 0:
            raise StopEpisode
        self._left -= 1
        return await self._policy.act(observation, info)
