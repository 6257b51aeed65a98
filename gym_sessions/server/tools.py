"""Tools: one declaration gives a server's HTTP tool route and its MCP tool.

A `Tool` names a handler that takes the request and its validated arguments
and returns a JSON object. The HTTP route ``POST /<name>`` and the MCP
``tools/call`` of ``<name>`` run the same handler against the same session.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.routing import Route

from gym_sessions.server.bodies import BodySchema, read_json
from gym_sessions.server.replies import JSONReply

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
    """

    name: str
    description: str
    arguments: BodySchema
    handler: ToolHandler

    @property
    def path(self) -> str:
        return f"/{self.name}"

    def route(self) -> Route:
        """The HTTP route of this tool."""

        async def endpoint(request: Request) -> JSONReply:
            arguments = self.arguments.validate(await read_json(request))
            return JSONReply(await self.handler(request, arguments))

        return Route(self.path, endpoint, methods=["POST"], name=self.name)

    def describe(self) -> dict[str, Any]:
        """This tool as an MCP ``Tool`` object."""
        return {
            "name": self.name,
            "description": self.description,
            "inputSchema": self.arguments.json_schema(),
        }
