"""The counter task's agent server: plays counter episodes (`envs.counter`) for ``/run``.

Its own module, so that a server of the counter env alone never imports the
agent side (aiohttp, the policies). Serve it with ``gym-sessions serve
envs.counter_agent:CounterAgent --workers 4 --allow-env http://127.0.0.1:8000``
(the counter env's URL).
"""

from __future__ import annotations

import json
from typing import Any

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

__all__ = ["CounterAgent"]


class CounterAgent(AgentServer):
    """The counter task's agent: ``/run`` plays a task, agent sessions keep a memory.

    ``/run`` takes ``{env_url, task: {initial_count, increments, expected_count}}``
    and steps each increment in order; with ``model: {base_url, name}`` it asks
    an OpenAI-compatible model for each increment instead (the task is in the
    prompt). ``env_url`` and ``base_url`` name servers the agent was started
    with (``--allow-env``, ``--allow-model``), by name or exact URL. Agent
    sessions hold a list of remembered values: ``POST /remember {value}``
    appends one and answers the count and total; the close receipt carries them.

    Serve it with ``gym-sessions serve envs.counter_agent:CounterAgent --workers 4
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
