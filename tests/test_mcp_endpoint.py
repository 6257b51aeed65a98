"""``POST /mcp`` (`gym_sessions.server.mcp`) in process: a whole single-worker app, ASGI calls.

The app is the real one a worker serves (`WorkerApp` with router, cookie
middleware and Starlette) around a `GymEnvServer` of the counter env; requests
are hand-built ASGI messages, so no socket or server process is involved. The
e2e tests (``tests/e2e/test_mcp.py``) drive the same endpoint over HTTP with the
official client.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

import gym_sessions
from envs.counter import CounterEnv
from gym_sessions.server.app import WorkerApp
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.settings import Settings
from tests.asgi import Reply, asgi_request

SECRET = "mcp-endpoint-test-secret-" + "x" * 20
TOKEN_HEADER = b"x-gym-session-token"
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
SERVER_ERROR = -32001


@dataclass
class Session:
    token: str
    cookie: bytes
    start: dict[str, Any]


class McpPeer:
    """Talks to one in-process app: session starts and JSON-RPC messages."""

    def __init__(self, app: WorkerApp) -> None:
        self.app = app

    async def start(self, initial: int = 0, **extra: Any) -> Session:
        body = json.dumps({"options": {"initial_count": initial}, **extra}).encode()
        reply = await asgi_request(self.app, "POST", "/reset", body)
        assert reply.status == 200, reply.body
        start = reply.json()
        cookie = reply.headers[b"set-cookie"].split(b";", 1)[0]
        return Session(start["mcp"]["headers"]["X-Gym-Session-Token"], cookie, start)

    async def post(
        self,
        body: bytes,
        token: str | bytes | None = None,
        *,
        cookie: bytes | None = None,
        path: str = "/mcp",
    ) -> Reply:
        headers = [(b"content-type", b"application/json")]
        if token is not None:
            headers.append((TOKEN_HEADER, token if isinstance(token, bytes) else token.encode()))
        if cookie is not None:
            headers.append((b"cookie", cookie))
        return await asgi_request(self.app, "POST", path, body, headers)

    async def rpc(self, message: dict[str, Any], token: str | None = None, **kw: Any) -> Reply:
        return await self.post(json.dumps(message).encode(), token, **kw)

    async def call(
        self, name: Any, arguments: Any = None, token: str | None = None, request_id: Any = 1
    ) -> Reply:
        params: dict[str, Any] = {"name": name}
        if arguments is not None:
            params["arguments"] = arguments
        message = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}
        return await self.rpc(message, token)

    async def episode_length(self, session: Session) -> int:
        reply = await self.call("observe", {}, session.token)
        return reply.json()["result"]["structuredContent"]["episode_length"]


@pytest.fixture
async def make_peer() -> AsyncIterator[Callable[..., Any]]:
    """``await make_peer(**settings)``: a started single-worker app; shut down at teardown."""
    apps: list[WorkerApp] = []

    async def make(**settings: Any) -> McpPeer:
        app = WorkerApp(GymEnvServer(CounterEnv), Settings(workers=1, secret=SECRET, **settings))
        await app.startup()
        apps.append(app)
        return McpPeer(app)

    yield make
    for app in apps:
        await app.shutdown()


@pytest.fixture
async def peer(make_peer) -> McpPeer:
    return await make_peer()


def rpc_error(reply: Reply, status: int, code: int, request_id: Any = 1) -> str:
    """The message of a plain JSON-RPC error reply, after checking its envelope."""
    assert reply.status == status, reply.body
    assert reply.headers[b"content-type"] == b"application/json"
    data = reply.json()
    assert set(data) == {"jsonrpc", "id", "error"}
    assert data["jsonrpc"] == "2.0" and data["id"] == request_id
    assert set(data["error"]) == {"code", "message"}
    assert data["error"]["code"] == code
    return data["error"]["message"]


def framework_error(reply: Reply, status: int, code: str, request_id: Any = 1) -> str:
    """The message of a framework error carried as a JSON-RPC error (code -32001)."""
    assert reply.status == status, reply.body
    data = reply.json()
    assert data["jsonrpc"] == "2.0" and data["id"] == request_id
    error = data["error"]
    assert error["code"] == SERVER_ERROR
    assert error["data"] == {"code": code, "status": status}
    assert error["message"].startswith(f"{code}: ")
    return error["message"][len(code) + 2 :]


def result(reply: Reply, request_id: Any = 1) -> dict[str, Any]:
    assert reply.status == 200, reply.body
    data = reply.json()
    assert data == {"jsonrpc": "2.0", "id": request_id, "result": data["result"]}
    return data["result"]


# Handshake and discovery ----------------------------------------------------------------------


async def test_initialize_echoes_a_known_protocol_version(peer):
    reply = await peer.rpc(
        {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {"protocolVersion": "2025-03-26", "capabilities": {}},
        }
    )
    assert result(reply) == {
        "protocolVersion": "2025-03-26",
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": {"name": "GymEnvServer", "version": gym_sessions.__version__},
        "instructions": "Tool calls need the X-Gym-Session-Token header from a session start.",
    }


@pytest.mark.parametrize("params", [{"protocolVersion": "1999-01-01"}, {}, None])
async def test_initialize_offers_the_newest_version_otherwise(peer, params):
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": 2, "method": "initialize"}
    if params is not None:
        message["params"] = params
    assert result(await peer.rpc(message), 2)["protocolVersion"] == "2025-11-25"


@pytest.mark.parametrize("request_id", [0, "", "abc", -5, 1.5, None])
async def test_ping_answers_with_the_requests_own_id(peer, request_id):
    reply = await peer.rpc({"jsonrpc": "2.0", "id": request_id, "method": "ping"})
    assert result(reply, request_id) == {}


async def test_tools_list_describes_every_tool_without_a_token(peer):
    tools = result(await peer.rpc({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}))["tools"]
    assert [tool["name"] for tool in tools] == ["step", "observe"]
    step, observe = tools
    assert step["inputSchema"] == {
        "type": "object",
        "properties": {
            "action": {
                "type": "integer",
                "minimum": -10,
                "maximum": 10,
                "description": "an element of the action space",
            }
        },
        "required": ["action"],
        "additionalProperties": False,
    }
    assert observe["inputSchema"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert observe["description"].startswith("Read the latest observation")


async def test_a_token_minted_with_a_tool_list_sees_and_calls_only_those(peer):
    session = await peer.start(4, mcp_tools=["observe"])
    listed = result(
        await peer.rpc({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, session.token)
    )
    assert [tool["name"] for tool in listed["tools"]] == ["observe"]
    refused = await peer.call("step", {"action": 1}, session.token)
    assert rpc_error(refused, 200, INVALID_PARAMS) == "unknown tool: 'step'"
    assert await peer.episode_length(session) == 0
    full = await peer.start(4)
    names = result(await peer.rpc({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, full.token))
    assert [tool["name"] for tool in names["tools"]] == ["step", "observe"]


# Tool calls -----------------------------------------------------------------------------------


async def test_a_tool_call_runs_against_the_tokens_session(peer):
    first, second = await peer.start(10), await peer.start(100)
    stepped = result(await peer.call("step", {"action": 3}, first.token, request_id="a"), "a")
    structured = {
        "observation": 13,
        "reward": 0.0,
        "terminated": False,
        "truncated": False,
        "info": {},
    }
    assert stepped == {
        "content": [{"type": "text", "text": json.dumps(structured)}],
        "structuredContent": structured,
        "isError": False,
    }
    observed = result(await peer.call("observe", None, second.token))
    assert observed["structuredContent"] == {"observation": 100, "episode_length": 0}
    assert await peer.episode_length(first) == 1


@pytest.mark.parametrize("params", [{"name": "observe"}, {"name": "observe", "arguments": None}])
async def test_absent_or_null_arguments_are_an_empty_object(peer, params):
    session = await peer.start(7)
    reply = await peer.rpc(
        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}, session.token
    )
    assert result(reply)["structuredContent"] == {"observation": 7, "episode_length": 0}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ([2], "arguments must be an object"),
        ("action=2", "arguments must be an object"),
        (False, "arguments must be an object"),
        ({}, "invalid arguments: body is missing the field 'action'"),
        ({"action": 1, "x": 2}, "invalid arguments: unknown field(s): 'x'"),
    ],
)
async def test_bad_arguments_are_invalid_params_and_nothing_runs(peer, arguments, message):
    session = await peer.start(1)
    reply = await peer.call("step", arguments, session.token, request_id=9)
    assert rpc_error(reply, 200, INVALID_PARAMS, 9) == message
    assert await peer.episode_length(session) == 0


@pytest.mark.parametrize("name", ["fly", "", 5, None, ["step"], {"name": "step"}])
async def test_unknown_tool_names_are_invalid_params(peer, name):
    session = await peer.start(1)
    assert rpc_error(await peer.call(name, {}, session.token), 200, INVALID_PARAMS) == (
        f"unknown tool: {name!r}"
    )


async def test_a_tools_own_failure_is_a_result_with_is_error(peer):
    session = await peer.start(1)
    outside = result(await peer.call("step", {"action": 99}, session.token))
    assert outside == {
        "content": [
            {"type": "text", "text": "invalid_request: action 99 is outside the action space"}
        ],
        "isError": True,
    }
    not_an_action = result(await peer.call("step", {"action": "up"}, session.token))
    assert not_an_action["isError"] is True
    assert not_an_action["content"][0]["text"].startswith(
        "invalid_request: action does not fit the action space"
    )
    assert await peer.episode_length(session) == 0


# Who may call ---------------------------------------------------------------------------------


async def test_a_call_without_a_token_is_401_as_a_json_rpc_error(peer):
    await peer.start(1)
    reply = await peer.call("step", {"action": 1}, request_id="r")
    assert framework_error(reply, 401, "invalid_token", "r") == (
        "tool calls need the X-Gym-Session-Token header of a session start"
    )


@pytest.mark.parametrize("token", [b"garbage", b"gAAAAAB" + b"x" * 100])
async def test_a_call_with_a_bad_token_is_401(peer, token):
    session = await peer.start(1)
    reply = await peer.call("step", {"action": 1}, token)
    assert framework_error(reply, 401, "invalid_token") == (
        "the X-Gym-Session-Token header is not a valid token of this session"
    )
    assert await peer.episode_length(session) == 0


async def test_a_tampered_token_is_401(peer):
    session = await peer.start(1)
    tampered = session.token[:-4] + ("AAAA" if not session.token.endswith("AAAA") else "BBBB")
    framework_error(await peer.call("step", {"action": 1}, tampered), 401, "invalid_token")
    assert await peer.episode_length(session) == 0


async def test_the_token_is_checked_before_the_arguments(peer):
    reply = await peer.call("step", {"bogus": 1})
    framework_error(reply, 401, "invalid_token")


async def test_a_token_with_another_sessions_cookie_acts_on_neither(peer):
    first, second = await peer.start(1), await peer.start(2)
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "step", "arguments": {"action": 5}},
    }
    reply = await peer.rpc(message, second.token, cookie=first.cookie)
    framework_error(reply, 401, "invalid_token")
    assert await peer.episode_length(first) == 0
    assert await peer.episode_length(second) == 0


async def test_the_token_of_a_closed_session_is_409_session_closed(peer):
    session = await peer.start(1)
    closed = await asgi_request(
        peer.app, "POST", "/close_session", b"", [(b"cookie", session.cookie)]
    )
    assert closed.status == 200 and closed.json()["outcome"] == "closed"
    reply = await peer.call("step", {"action": 1}, session.token)
    sid = session.start["resources_session_id"]
    assert framework_error(reply, 409, "session_closed") == f"session {sid!r} is closed"


# Notifications and framing --------------------------------------------------------------------


@pytest.mark.parametrize("method", ["notifications/initialized", "tools/call", "no/such"])
async def test_a_notification_is_202_with_no_body_and_runs_nothing(peer, method):
    session = await peer.start(1)
    message = {
        "jsonrpc": "2.0",
        "method": method,
        "params": {"name": "step", "arguments": {"action": 1}},
    }
    reply = await peer.rpc(message, session.token)
    assert (reply.status, reply.body) == (202, b"")
    assert await peer.episode_length(session) == 0


@pytest.mark.parametrize(
    "body",
    [b"{oops", b"", b"   ", b'{"jsonrpc": "2.0", "id": 1, "method": "ping", "x": NaN}', b"\xff"],
)
async def test_a_body_that_is_not_json_is_a_parse_error(peer, body):
    message = rpc_error(await peer.post(body), 400, PARSE_ERROR, None)
    assert message.startswith("parse error: ")


@pytest.mark.parametrize(
    "message",
    [
        [],
        [{"jsonrpc": "2.0", "id": 1, "method": "ping"}],  # batches are not supported
        "ping",
        42,
        None,
        {"id": 1, "method": "ping"},
        {"jsonrpc": "1.0", "id": 1, "method": "ping"},
        {"jsonrpc": 2.0, "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": 1, "method": None},
    ],
)
async def test_a_message_that_is_not_a_request_object_is_invalid_request(peer, message):
    reply = await peer.rpc(message)
    assert rpc_error(reply, 400, INVALID_REQUEST, None) == "not a JSON-RPC 2.0 request object"


@pytest.mark.parametrize("method", ["no/such", "resources/list", "prompts/list", "Ping"])
async def test_an_unknown_method_is_method_not_found(peer, method):
    reply = await peer.rpc({"jsonrpc": "2.0", "id": 3, "method": method})
    assert rpc_error(reply, 200, METHOD_NOT_FOUND, 3) == f"method not found: {method}"


@pytest.mark.parametrize("params", [[1], "x", 7, True])
async def test_params_that_are_not_an_object_are_invalid_params(peer, params):
    reply = await peer.rpc({"jsonrpc": "2.0", "id": 4, "method": "ping", "params": params})
    assert rpc_error(reply, 200, INVALID_PARAMS, 4) == "params must be an object"


@pytest.mark.parametrize("params", [[], False, 0, ""])
async def test_falsy_params_that_are_not_an_object_are_invalid_params(peer, params):
    reply = await peer.rpc({"jsonrpc": "2.0", "id": 4, "method": "ping", "params": params})
    assert rpc_error(reply, 200, INVALID_PARAMS, 4) == "params must be an object"


@pytest.mark.parametrize("method", ["GET", "DELETE"])
async def test_get_and_delete_are_405_allowing_post(peer, method):
    reply = await asgi_request(peer.app, method, "/mcp")
    assert reply.status == 405
    assert reply.headers[b"allow"] == b"POST"
    assert reply.json() == {
        "error": {"code": "method_not_allowed", "message": f"{method} is not allowed on /mcp"}
    }


async def test_put_is_405_too(peer):
    reply = await asgi_request(peer.app, "PUT", "/mcp", b"{}")
    assert reply.status == 405
    assert reply.json()["error"]["code"] == "method_not_allowed"


async def test_the_endpoint_answers_under_a_rollout_prefix(peer):
    session = await peer.start(20)
    message = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "step", "arguments": {"action": -4}},
    }
    reply = await peer.rpc(message, session.token, path="/rollouts/r-1/mcp")
    assert result(reply)["structuredContent"]["observation"] == 16


async def test_the_routers_own_errors_on_mcp_are_json_rpc_errors(make_peer):
    peer = await make_peer(max_body_bytes=64)
    message = {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "x" * 100}}
    reply = await peer.rpc(message)
    # The router refuses before the body is parsed, so the request id is unknown.
    assert framework_error(reply, 413, "body_too_large", None) == (
        "request body is larger than 64 bytes"
    )
    plain = await asgi_request(peer.app, "POST", "/step", json.dumps(message).encode())
    assert plain.status == 413 and plain.json()["error"]["code"] == "body_too_large"
