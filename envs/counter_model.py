"""A scripted OpenAI-compatible chat model for the counter agent, one that sometimes errs.

Serve it with ``gym-sessions serve gym_sessions.examples.counter_model:app`` (one
worker: it keeps the conversations it answered in memory) and give its URL to
the counter agent's ``/run`` as ``model: {"base_url": URL}``. It answers
``POST /v1/chat/completions`` with a call of the ``step`` tool: the next
increment of the task that the system message carries. Most tasks it plays
right; for some it makes one mistake, the same one every time, chosen from the
task itself (`mistake_of`):

- ``wrong_sign``: one step subtracts its increment instead of adding it, so the
  count ends wrong and ``/verify`` scores 0.0;
- ``count_as_action``: one step answers the count it is aiming for instead of the
  increment, which is either a wrong increment (scored 0.0) or outside the action
  space (the env server refuses the step and ``/run`` answers 502);
- ``truncated_arguments``: one tool call's arguments are cut-off JSON, so the
  agent cannot read an action and ``/run`` answers 502.

``GET /v1/conversations`` lists every conversation so far (its task, the
messages the model was sent and its last reply), in the order they began:
the transcripts of the agent's runs.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

__all__ = ["MISTAKES", "app", "mistake_of"]

#: What the model may get wrong, and how often: one task in ten for each.
MISTAKES = ("wrong_sign", "count_as_action", "truncated_arguments")

# Keyed by the system message (it holds the task), in the order conversations began.
_conversations: dict[str, dict[str, Any]] = {}


def mistake_of(task: dict[str, Any]) -> tuple[str | None, int]:
    """The mistake the model makes on ``task`` (``None``: none) and at which step (0-based)."""
    digest = zlib.crc32(json.dumps(task, sort_keys=True).encode())
    kind = digest % 10
    step = (digest // 10) % max(1, len(task.get("increments", [])))
    return (MISTAKES[kind] if kind < len(MISTAKES) else None), step


def _arguments(task: dict[str, Any], step: int, messages: list[dict[str, Any]]) -> str:
    increment = task["increments"][step]
    mistake, at = mistake_of(task)
    if mistake is None or step != at:
        return json.dumps({"action": increment})
    if mistake == "wrong_sign":
        return json.dumps({"action": -increment})
    if mistake == "count_as_action":
        count = json.loads(messages[-1]["content"])["observation"]
        return json.dumps({"action": count + increment})
    return json.dumps({"action": increment})[:-3]  # cut off before its end


async def chat_completions(request: Request) -> JSONResponse:
    body = await request.json()
    tools = {tool["function"]["name"] for tool in body.get("tools", [])}
    if "step" not in tools:
        return JSONResponse({"error": {"message": "no step tool offered"}}, status_code=400)
    messages = body["messages"]
    task = json.loads(messages[0]["content"])["task"]
    step = sum(1 for message in messages if message["role"] == "assistant")
    call = {
        "id": f"call_{step}",
        "type": "function",
        "function": {"name": "step", "arguments": _arguments(task, step, messages)},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    _conversations[messages[0]["content"]] = {"task": task, "messages": [*messages, message]}
    return JSONResponse(
        {
            "id": f"chatcmpl-{step}",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        }
    )


async def conversations(request: Request) -> JSONResponse:
    return JSONResponse({"conversations": list(_conversations.values())})


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "conversations": len(_conversations)})


app = Starlette(
    routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/conversations", conversations),
        Route("/health", health),
    ]
)
