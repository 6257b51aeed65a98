"""Tools: one declaration gives a server's HTTP tool route and its MCP tool.

A `Tool` names a handler that takes the request and its validated arguments
and returns a JSON object. The HTTP route ``POST /<name>`` and the MCP
``tools/call`` of ``<name>`` run the same handler against the same session.
A tool that `carries_values` may hold space values in its arguments
(``action``) and result (``observation``): its HTTP route takes and answers
them in JSON or, when asked, binary (`gym_sessions.value_messages`); MCP
always gets JSON.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gym_sessions.server.bodies import BodySchema, read_json, read_value_body
from gym_sessions.server.replies import send_json_reply, send_value_reply
from gym_sessions.value_messages import STEP_BODY, VALUE_REPLY, reply_encoding_of

__all__ = ["Tool", "ToolHandler"]

ToolHandler = Callable[[Request, dict[str, Any]], Awaitable[dict[str, Any]]]


@dataclass(frozen=True)
class Tool:
    """A tool of a resources server.

    Attributes:
        name: Tool name; the HTTP route is ``POST /<name>``.
        description: What the tool does (shown to agents by ``tools/list``).
        arguments: The JSON object the tool takes.
        handler: ``await handler(request, arguments) -> result``; it uses the
            request's session through `session_id`.
        carries_values: ``arguments["action"]`` may be a `BinaryValue`, and
            ``result["observation"]`` a `SpaceValue` (see the module).
    """

    name: str
    description: str
    arguments: BodySchema
    handler: ToolHandler
    carries_values: bool = False

    @property
    def path(self) -> str:
        return f"/{self.name}"

    def route(self) -> Route:
        """The HTTP route of this tool."""
        return Route(self.path, _ToolEndpoint(self), methods=["POST"], name=self.name)

    def describe(self) -> dict[str, Any]:
        """This tool as an MCP ``Tool`` object."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.arguments.json_schema(),
        }


class _ToolEndpoint:
    """A tool's HTTP route as an ASGI app: the request's arguments in, the handler's JSON out.

    Not a request function: Starlette would wrap one in its request/response
    adapter (two coroutines, an exception wrapper and a ``send`` wrapper per
    request, then a response object), for the same reply. An error raised here
    reaches the app's exception handlers as from any route (Starlette's
    exception middleware applies the same handlers the adapter would).
    """

    def __init__(self, tool: Tool) -> None:
        self.tool = tool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive, send)
        tool = self.tool
        if not tool.carries_values:
            arguments = tool.arguments.validate(await read_json(request))
            await send_json_reply(send, await tool.handler(request, arguments))
            return
        encoding = reply_encoding_of(scope)
        arguments = tool.arguments.validate(await read_value_body(request, STEP_BODY))
        result = await tool.handler(request, arguments)
        await send_value_reply(send, result, encoding, VALUE_REPLY)
