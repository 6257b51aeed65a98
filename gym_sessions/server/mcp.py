"""``POST /mcp``: the Model Context Protocol over streamable HTTP, stateless, JSON replies.

A small hand-written subset (``initialize``, ``ping``, ``tools/list``,
``tools/call``, notifications) rather than the SDK's session manager: every
tool call must run inside this request's handling, on the worker the router
chose, with this request's session. The official MCP client is the test peer.

Tool calls authenticate with the session token of a session start
(``X-Gym-Session-Token``): no token, a bad one or one of an ended incarnation is
refused (HTTP 401), and the call runs against the token's session. A token
minted with a tool list (``mcp_tools`` in the start body) lists and calls only
those tools; to its holder the others do not exist. A tool's own failure (an action outside
the space, no open episode) is a result with ``isError``, so an agent can read
it; a session-level failure is a JSON-RPC error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gym_sessions import __version__, strict_json
from gym_sessions.errors import (
    HTTPError,
    InvalidRequestError,
    InvalidTokenError,
    MethodNotAllowedError,
    SessionConflictError,
    SessionGoneError,
    error_body,
    error_headers,
    jsonrpc_error_body,
)
from gym_sessions.routing.request_session import request_session
from gym_sessions.routing.session_ids import SESSION_TOKEN_HEADER
from gym_sessions.server.tools import Tool
from gym_sessions.value_messages import VALUE_REPLY, json_content

__all__ = ["MCP_PATH", "SESSION_TOKEN_HEADER_NAME", "McpEndpoint"]

MCP_PATH = "/mcp"
SESSION_TOKEN_HEADER_NAME = "X-Gym-Session-Token"
assert SESSION_TOKEN_HEADER_NAME.lower() == SESSION_TOKEN_HEADER

# Versions whose handshake is `initialize`; the newest is offered when a client
# asks for one we do not know.
_PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
# Errors about the session itself end the call; any other failure is the tool's result.
_SESSION_ERRORS = (InvalidTokenError, SessionConflictError, SessionGoneError)


def _error(request_id: Any, code: int, message: str, status: int = 200) -> JSONResponse:
    return JSONResponse(
        {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}},
        status_code=status,
    )


def _framework_error(request_id: Any, error: HTTPError) -> Response:
    headers = {name.decode(): value.decode() for name, value in error_headers(error)}
    return Response(
        jsonrpc_error_body(error, request_id),
        error.status,
        headers=headers,
        media_type="application/json",
    )


def _result(request_id: Any, result: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"jsonrpc": "2.0", "id": request_id, "result": result})


class McpEndpoint:
    """The ``/mcp`` route of one resources server.

    Args:
        tools: The server's tools.
        session_of: The request's session id (reading it uses the session).
        name: Server name reported by ``initialize``.
    """

    def __init__(
        self,
        tools: list[Tool],
        session_of: Callable[[Request], str],
        name: str,
    ) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._session_of = session_of
        self._name = name

    def route(self) -> Route:
        """``POST /mcp`` (GET and DELETE answer 405: there is no stream or session to end)."""
        return Route(MCP_PATH, self.handle, methods=["POST", "GET", "DELETE"])

    async def handle(self, request: Request) -> Response:
        if request.method != "POST":
            # Stateless: no stream to open with GET, no session to end with DELETE.
            error = MethodNotAllowedError(f"{request.method} is not allowed on {MCP_PATH}")
            return Response(
                error_body(error), 405, headers={"Allow": "POST"}, media_type="application/json"
            )
        try:
            message = strict_json.loads(await request.body())
        except ValueError as exc:
            return _error(None, PARSE_ERROR, f"parse error: {exc}", 400)
        if (
            not isinstance(message, dict)
            or message.get("jsonrpc") != "2.0"
            or not isinstance(message.get("method"), str)
        ):
            return _error(None, INVALID_REQUEST, "not a JSON-RPC 2.0 request object", 400)
        if "id" not in message:
            return Response(status_code=202)  # a notification: nothing to answer
        request_id, method = message["id"], message["method"]
        params = message.get("params")
        if params is None:  # absent or null: no parameters
            params = {}
        if not isinstance(params, dict):
            return _error(request_id, INVALID_PARAMS, "params must be an object")
        if method == "initialize":
            return _result(request_id, self._initialize(params))
        if method == "ping":
            return _result(request_id, {})
        if method == "tools/list":
            tools = [t.describe() for t in self._tools.values() if self._may_use(request, t.name)]
            return _result(request_id, {"tools": tools})
        if method == "tools/call":
            return await self._call(request, request_id, params)
        return _error(request_id, METHOD_NOT_FOUND, f"method not found: {method}")

    def _initialize(self, params: dict[str, Any]) -> dict[str, Any]:
        asked = params.get("protocolVersion")
        return {
            "protocolVersion": asked if asked in _PROTOCOL_VERSIONS else _PROTOCOL_VERSIONS[0],
            "capabilities": {"tools": {"listChanged": False}},
            "serverInfo": {"name": self._name, "version": __version__},
            "instructions": (
                f"Tool calls need the {SESSION_TOKEN_HEADER_NAME} header from a session start."
            ),
        }

    async def _call(self, request: Request, request_id: Any, params: dict[str, Any]) -> Response:
        name = params.get("name")
        tool = self._tools.get(name) if isinstance(name, str) else None
        if tool is None or not self._may_use(request, tool.name):
            return _error(request_id, INVALID_PARAMS, f"unknown tool: {name!r}")
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        elif not isinstance(arguments, dict):
            return _error(request_id, INVALID_PARAMS, "arguments must be an object")
        try:
            self._check_token(request)
            arguments = tool.arguments.validate(arguments)
        except InvalidRequestError as error:
            return _error(request_id, INVALID_PARAMS, f"invalid arguments: {error.message}")
        except HTTPError as error:
            return _framework_error(request_id, error)
        try:
            # MCP gets values as JSON whatever the HTTP request's Accept says.
            structured = json_content(await tool.handler(request, arguments), VALUE_REPLY)
        except _SESSION_ERRORS as error:
            return _framework_error(request_id, error)
        except HTTPError as error:
            text = f"{error.code}: {error.message}"
            return _result(
                request_id,
                {"content": [{"type": "text", "text": text}], "isError": True},
            )
        return _result(
            request_id,
            {
                "content": [{"type": "text", "text": json.dumps(structured)}],
                "structuredContent": structured,
                "isError": False,
            },
        )

    @staticmethod
    def _may_use(request: Request, tool_name: str) -> bool:
        token = request_session(request.scope).token
        return token is None or token.tools is None or tool_name in token.tools

    def _check_token(self, request: Request) -> None:
        # The router verified the token and dropped it if it belongs to
        # another incarnation; the header says whether one was sent at all.
        token = request_session(request.scope).token
        if token is None:
            sent = request.headers.get(SESSION_TOKEN_HEADER)
            raise InvalidTokenError(
                f"the {SESSION_TOKEN_HEADER_NAME} header is not a valid token of this session"
                if sent
                else f"tool calls need the {SESSION_TOKEN_HEADER_NAME} header of a session start"
            )
        if self._session_of(request) != token.session_id:
            raise SessionConflictError(
                "the session cookie and the session token name different sessions"
            )
