"""A fake OpenAI-compatible model server for agent tests (served by ``gym-sessions serve``).

It answers ``/v1/chat/completions`` with a call of the ``step`` tool. The
system message carries the counter task as JSON; the answer is the increment
after the ones already called in the conversation, so a correct agent scores
1.0 and a confused conversation does not.
"""

import json

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def chat_completions(request: Request) -> JSONResponse:
    body = await request.json()
    tools = {tool["function"]["name"]: tool for tool in body.get("tools", [])}
    if "step" not in tools or "action" not in tools["step"]["function"]["parameters"]["properties"]:
        return JSONResponse({"error": {"message": "no step tool offered"}}, status_code=400)
    messages = body["messages"]
    task = json.loads(messages[0]["content"])["task"]
    calls_so_far = sum(1 for m in messages if m["role"] == "assistant")
    increment = task["increments"][calls_so_far]
    call = {
        "id": f"call_{calls_so_far}",
        "type": "function",
        "function": {"name": "step", "arguments": json.dumps({"action": increment})},
    }
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return JSONResponse(
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "model": body.get("model"),
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
        }
    )


async def health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


app = Starlette(
    routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/health", health),
    ]
)
