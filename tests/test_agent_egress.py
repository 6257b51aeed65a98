"""What an agent's ``/run`` tells its client about the upstreams it called (issue 33).

Loopback only: small asyncio servers stand in for a local service that must not
leak (its reply holds a secret) and for one that accepts and never answers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from envs.counter import CounterAgent
from gym_sessions.server.app import WorkerApp
from gym_sessions.settings import Settings
from tests.asgi import asgi_request

SECRET = "s" * 40
LEAK = "INTERNAL-SECRET-BODY admin-token=hunter2"


class QuickAgent(CounterAgent):
    """The counter agent with short upstream timeouts (the attribute a deployment sets)."""

    upstream_connect_timeout = 0.5
    upstream_timeout = 0.5


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _answering(status: str, body: bytes, content_type: str) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    return handle


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)  # accepts, reads nothing, never answers


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server, url = await _serve(handler)
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.close()


async def _run(agent: CounterAgent, body: dict[str, Any]) -> Any:
    app = WorkerApp(agent, Settings(secret=SECRET))
    reply = await asgi_request(app, "POST", "/run", json.dumps(body).encode())
    return reply


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        ("500 Internal Server Error", LEAK.encode(), "text/plain"),
        ("200 OK", LEAK.encode(), "text/plain"),
        (
            "400 Bad Request",
            json.dumps({"error": {"code": "invalid_request", "message": LEAK}}).encode(),
            "application/json",
        ),
        (
            "400 Bad Request",
            json.dumps({"error": {"code": LEAK, "message": "x"}}).encode(),
            "application/json",
        ),
    ],
    ids=["500-text", "200-text", "json-error-message", "json-error-code"],
)
async def test_no_byte_of_an_upstream_reply_reaches_the_client(
    upstream, status, body, content_type
):
    url = await upstream(_answering(status, body, content_type))
    reply = await _run(QuickAgent(), {"env_url": url, "task": {"increments": [1]}})
    assert reply.status == 502
    assert "SECRET" not in reply.body.decode() and "hunter2" not in reply.body.decode()


async def test_a_reply_without_its_fields_is_bad_upstream_naming_the_field(upstream):
    spaces = json.dumps({"hello": 1}).encode()
    url = await upstream(_answering("200 OK", spaces, "application/json"))
    reply = await _run(QuickAgent(), {"env_url": url, "task": {"increments": [1]}})
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "bad_upstream"
    assert "action_space" in reply.json()["error"]["message"]


async def test_an_upstream_that_never_answers_is_cut_off_by_the_total_timeout(upstream):
    url = await upstream(_silent)
    reply = await asyncio.wait_for(
        _run(QuickAgent(), {"env_url": url, "task": {"increments": [1]}}), timeout=60
    )
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "bad_gateway"
