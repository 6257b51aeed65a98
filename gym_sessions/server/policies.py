"""Policies an agent server plays episodes with.

A policy is any object with ``act(observation, info) -> action``, sync or
async. `ScriptedPolicy` replays a list of actions (tests, examples, the counter
task); `ChatCompletionsPolicy` asks an OpenAI-compatible chat-completions server
for a tool call whose arguments are the action.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterable
from typing import Any, Protocol

import aiohttp

from gym_sessions.errors import BadGatewayError, BadUpstreamError, RefusedReplyError

__all__ = ["ChatCompletionsPolicy", "Policy", "ScriptedPolicy", "StopEpisode", "act"]


class StopEpisode(Exception):
    """Raised by a policy that has no more actions: the episode is verified as it stands."""


class Policy(Protocol):
    """Chooses an action from an observation (``act`` may be a coroutine function)."""

    def act(self, observation: Any, info: dict[str, Any]) -> Any: ...


async def act(policy: Policy, observation: Any, info: dict[str, Any]) -> Any:
    """The policy's action, awaiting it when ``act`` is async."""
    action = policy.act(observation, info)
    if inspect.isawaitable(action):
        action = await action
    return action


class ScriptedPolicy:
    """Plays the given actions in order, then stops the episode."""

    def __init__(self, actions: Iterable[Any]) -> None:
        self._actions = iter(actions)

    def act(self, observation: Any, info: dict[str, Any]) -> Any:
        try:
            return next(self._actions)
        except StopIteration:
            raise StopEpisode from None


class ChatCompletionsPolicy:
    """Asks an OpenAI-compatible ``/v1/chat/completions`` server for the next action.

    The model sees the task and the latest observation, and must answer with a
    call of the ``step`` tool whose ``action`` argument follows the env's action
    schema (the same schema ``/mcp`` lists). The conversation grows with each
    step, as a chat agent's does.

    Args:
        client: The aiohttp session to reach the model server with (an agent's
            `AgentServer.http_client`, which calls allowed upstreams only).
        base_url: The model server, e.g. ``http://127.0.0.1:8001`` (``/v1/...``
            appended); an agent takes it from `AgentServer.model_url`.
        model: The model name to ask for.
        action_schema: JSON Schema of an action.
        task: Text telling the model what to do.
    """

    def __init__(
        self,
        client: aiohttp.ClientSession,
        base_url: str,
        model: str,
        action_schema: dict[str, Any],
        task: str,
    ) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/v1/chat/completions"
        self._model = model
        self._tools = [
            {
                "type": "function",
                "function": {
                    "name": "step",
                    "description": "Take one action in the environment.",
                    "parameters": {
                        "type": "object",
                        "properties": {"action": action_schema},
                        "required": ["action"],
                    },
                },
            }
        ]
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": task}]
        self._last_call_id: str | None = None

    async def act(self, observation: Any, info: dict[str, Any]) -> Any:
        seen = json.dumps({"observation": observation, "info": info})
        if self._last_call_id is None:
            self.messages.append({"role": "user", "content": seen})
        else:  # the observation is the result of the previous step call
            self.messages.append(
                {"role": "tool", "tool_call_id": self._last_call_id, "content": seen}
            )
        body = {
            "model": self._model,
            "messages": self.messages,
            "tools": self._tools,
            "tool_choice": {"type": "function", "function": {"name": "step"}},
        }
        try:
            async with self._client.post(self._url, json=body) as reply:
                if reply.status != 200:
                    # The status only: the reply's bytes may be any local service's (issue 33).
                    raise BadGatewayError(f"model server {self._url} replied {reply.status}")
                data = await reply.json(content_type=None)
        except ValueError:
            raise BadUpstreamError(f"model server {self._url}: the reply is not JSON") from None
        except RefusedReplyError as refused:
            raise BadUpstreamError(f"model server {self._url}: {refused}") from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BadGatewayError(f"model server at {self._url} failed: {exc!r}") from exc
        try:
            message = data["choices"][0]["message"]
            call = message["tool_calls"][0]
            action = json.loads(call["function"]["arguments"])["action"]
        except (KeyError, IndexError, TypeError, ValueError):
            raise BadUpstreamError(
                f"model server {self._url}: the reply has no field "
                "choices[0].message.tool_calls[0].function.arguments.action"
            ) from None
        self.messages.append(message)
        self._last_call_id = call.get("id", "call")
        return action
