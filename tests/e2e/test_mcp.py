"""MCP over /mcp with the official MCP client and raw JSON-RPC, against real servers."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from envs.counter_load import client_session, make_episodes, play_over_mcp

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
TOKEN = "X-Gym-Session-Token"


async def start_session(url: str, initial: int, **extra) -> dict:
    async with client_session() as client:
        body = {"options": {"initial_count": initial}, **extra}
        async with client.post(url + "/reset", json=body) as reply:
            assert reply.status == 200
            return await reply.json()


def mcp_client(url: str, token: str | None, mode: str = "legacy"):
    headers = {TOKEN: token} if token else {}
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=60))
    return http, Client(streamable_http_client(url + "/mcp", http_client=http), mode=mode)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_official_client_lists_and_calls_tools_with_the_token(shared_serve, mode):
    server = shared_serve(COUNTER)
    start = await start_session(server.url, 40)
    assert start["mcp"]["url_path"] == "/mcp"
    token = start["mcp"]["headers"][TOKEN]
    http, client = mcp_client(server.url, token, mode)
    async with http, client:
        await client.session.send_ping()
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(tools) == {"step", "observe"}
        action = tools["step"].input_schema["properties"]["action"]
        assert action == {
            "type": "integer",
            "minimum": -10,
            "maximum": 10,
            "description": "an element of the action space",
        }
        assert tools["step"].input_schema["required"] == ["action"]
        result = await client.call_tool("step", {"action": 2})
        assert not result.is_error
        assert result.structured_content["observation"] == 42
        assert json.loads(result.content[0].text)["observation"] == 42
        observed = await client.call_tool("observe", {})
        assert observed.structured_content == {"observation": 42, "episode_length": 1}
        # A tool's own failure is a result the agent can read.
        bad = await client.call_tool("step", {"action": 99})
        assert bad.is_error
        assert "outside the action space" in bad.content[0].text


async def test_missing_tampered_and_foreign_tokens_are_refused(serve, shared_serve):
    server = shared_serve(COUNTER)
    start = await start_session(server.url, 1)
    token = start["mcp"]["headers"][TOKEN]
    other_server = serve(COUNTER)  # another secret signs another server's tokens
    foreign = (await start_session(other_server.url, 1))["mcp"]["headers"][TOKEN]
    for bad in (None, token[:-3] + "abc", foreign, "not-a-token"):
        http, client = mcp_client(server.url, bad)
        async with http, client:
            assert {t.name for t in (await client.list_tools()).tools} == {"step", "observe"}
            with pytest.raises(MCPError, match="invalid_token"):
                await client.call_tool("step", {"action": 1})
    # The real session is untouched.
    http, client = mcp_client(server.url, token)
    async with http, client:
        assert (await client.call_tool("observe", {})).structured_content["observation"] == 1


async def test_token_of_a_closed_session_is_refused(shared_serve):
    server = shared_serve(COUNTER)
    key = "the-owners-key-" + "k" * 20
    start = await start_session(server.url, 5, session_key=key)
    token = start["mcp"]["headers"][TOKEN]
    async with client_session() as client:
        body = {"resources_session_id": start["resources_session_id"], "session_key": key}
        async with client.post(server.url + "/close_session", json=body) as reply:
            assert (await reply.json())["outcome"] == "closed"
    http, client = mcp_client(server.url, token)
    async with http, client:
        with pytest.raises(MCPError, match="session_closed"):
            await client.call_tool("step", {"action": 1})


async def test_malformed_json_rpc_gets_its_error(shared_serve):
    server = shared_serve(COUNTER)
    token = (await start_session(server.url, 0))["mcp"]["headers"][TOKEN]
    cases = [
        (b"{oops", 400, -32700),
        (b"[1, 2]", 400, -32600),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', 400, -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "no/such"}', 200, -32601),
        (
            b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "fly"}}',
            200,
            -32602,
        ),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": []}', 200, -32602),
        (
            b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", '
            b'"params": {"name": "step", "arguments": {"action": 1, "x": 2}}}',
            200,
            -32602,
        ),
    ]
    async with client_session() as client:
        for body, status, code in cases:
            async with client.post(
                server.url + "/mcp",
                data=body,
                headers={TOKEN: token, "Content-Type": "application/json"},
            ) as reply:
                data = await reply.json(content_type=None)
                assert reply.status == status, body
                assert data["error"]["code"] == code, body
        async with client.post(
            server.url + "/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"}
        ) as reply:
            assert reply.status == 202
        async with client.get(server.url + "/mcp") as reply:
            assert reply.status == 405


async def _mcp_sequences(url: str, n: int) -> int:
    async with client_session() as client:
        done = await asyncio.gather(
            *[play_over_mcp(client, url, e) for e in make_episodes(n, seed=9)]
        )
    return sum(e.reward == 1.0 for e in done)


def test_200_mcp_sequences_with_only_the_token_at_4_workers(shared_serve):
    server = shared_serve(COUNTER, workers=4)
    assert asyncio.run(_mcp_sequences(server.url, 200)) == 200


def test_mcp_sequences_fail_without_routing(serve):
    server = serve(COUNTER, "--no-routing", workers=4)
    correct = asyncio.run(_mcp_sequences(server.url, 200))
    print(f"\nMCP, --no-routing, 4 workers: {correct} of 200 sequences ended with the right count")
    assert correct < 160
