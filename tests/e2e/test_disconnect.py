"""A client that disconnects mid-request cancels its handler, here or across the hop.

NeMo Gym cancels a handler whose client disconnected; gym-sessions does too
(`gym_sessions.routing.disconnect`). Each test starts a request on a raw
connection, closes the connection while the handler runs, and then checks
that the session answers consistently:

- an awaiting tool is cancelled (its tally says so), on the worker that holds
  the session, also when another worker accepted the connection and forwarded
  it (the hop's closed connection is the claimant's disconnect);
- a step cannot be interrupted (the env runs it without awaiting): it
  completes and is recorded once, and the session steps on from there;
- an agent's ``/run`` is cancelled: its ``finally`` closes the env session at
  once instead of playing the episode to its end.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from typing import Any

import pytest

from tests.polling import eventually

pytestmark = pytest.mark.e2e

SLOW_TOOLS = "tests.e2e.slow_tools:SlowToolServer"
SLOW_ENV = "tests.e2e.slow_env:SlowCounterEnv"
AGENT = "tests.e2e.scripted_agent:ScriptedAgent"
COOKIE = "gym_session"


def _address(url: str) -> tuple[str, int]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _request(method: str, path: str, body: Any = None, cookie: str | None = None) -> bytes:
    payload = b"" if body is None else json.dumps(body).encode()
    head = [f"{method} {path} HTTP/1.1", "Host: test", f"Content-Length: {len(payload)}"]
    if body is not None:
        head.append("Content-Type: application/json")
    if cookie is not None:
        head.append(f"Cookie: {COOKIE}={cookie}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + payload


async def _read_reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, list[str]], Any]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers: dict[str, list[str]] = {}
    for line in head[1:]:
        if line:
            name, _, value = line.partition(":")
            headers.setdefault(name.strip().lower(), []).append(value.strip())
    body = await reader.readexactly(int(headers.get("content-length", ["0"])[0]))
    return int(head[0].split()[1]), headers, json.loads(body) if body else None


async def call(
    url: str, method: str, path: str, body: Any = None, cookie: str | None = None
) -> tuple[int, dict[str, list[str]], Any]:
    """One request on a new connection: status, headers, JSON body."""
    reader, writer = await asyncio.open_connection(*_address(url))
    try:
        writer.write(_request(method, path, body, cookie))
        await writer.drain()
        return await asyncio.wait_for(_read_reply(reader), 30)
    finally:
        writer.close()


def cookie_of(headers: dict[str, list[str]]) -> str:
    for header in headers.get("set-cookie", []):
        name, _, value = header.split(";", 1)[0].partition("=")
        if name.strip() == COOKIE:
            return value.strip()
    raise AssertionError(f"no session cookie in {headers}")


async def send_unanswered(
    url: str,
    path: str,
    body: Any,
    cookie: str | None = None,
    *,
    avoid_worker: str | None = None,
) -> tuple[asyncio.StreamWriter, str]:
    """POST on a new connection without reading the reply; the connection and its worker.

    With ``avoid_worker`` (the session's holder) the connection is one another
    worker accepted, found by asking ``/health`` on it first (the worker that
    answers a request naming no session is the one that accepted it), so the
    request is forwarded. Closing the returned writer is the client leaving.
    """
    for _ in range(100):
        reader, writer = await asyncio.open_connection(*_address(url))
        writer.write(_request("GET", "/health"))
        await writer.drain()
        _, _, health = await asyncio.wait_for(_read_reply(reader), 30)
        if avoid_worker is not None and health["worker"] == avoid_worker:
            writer.close()
            continue
        writer.write(_request("POST", path, body, cookie))
        await writer.drain()
        return writer, health["worker"]
    raise AssertionError(f"every connection landed on worker {avoid_worker}")


async def leave(writer: asyncio.StreamWriter, after: float) -> None:
    await asyncio.sleep(after)
    writer.close()
    await writer.wait_closed()


async def start(url: str, sid: str, options: dict[str, Any]) -> tuple[str, str]:
    """Start ``sid``; its cookie and the worker holding it."""
    status, headers, reply = await call(
        url, "POST", "/reset", {"resources_session_id": sid, "options": options}
    )
    assert status == 200, reply
    return cookie_of(headers), headers["x-gym-worker"][0]


# At 4 workers a client that leaves meets the local and the forwarded path
# both; 1 worker (the local path alone) runs in the full run only.
WORKER_COUNTS = [pytest.param(1, marks=pytest.mark.slow), 4]


@pytest.mark.parametrize("workers", WORKER_COUNTS)
async def test_an_awaiting_tool_is_cancelled_when_its_client_leaves(serve, workers):
    server = serve(SLOW_TOOLS, "--debug-worker-header", workers=workers)
    cookie, holder = await start(server.url, "slow-tool-1", {})
    connection, accepted = await send_unanswered(
        server.url, "/wait", {"seconds": 60}, cookie, avoid_worker=holder if workers > 1 else None
    )
    assert workers == 1 or accepted != holder  # forwarded: the hop passes the disconnect on
    await leave(connection, after=1.0)

    async def tally() -> dict[str, int] | None:
        status, _, reply = await call(server.url, "POST", "/tally", {}, cookie)
        assert status == 200, reply
        return reply if reply["cancelled"] else None

    expected = {"started": 1, "finished": 0, "cancelled": 1, "starts": 1}
    assert await eventually(tally, 5) == expected
    # The session goes on: the next call runs and finishes.
    status, _, reply = await call(server.url, "POST", "/wait", {"seconds": 0.05}, cookie)
    assert (status, reply) == (200, {**expected, "started": 2, "finished": 1})


@pytest.mark.parametrize("workers", WORKER_COUNTS)
async def test_a_seed_whose_client_leaves_runs_to_completion(serve, workers):
    """A start is not cancelled: the lost reply's retry finds the session the seed made."""
    server = serve(SLOW_TOOLS, "--debug-worker-header", workers=workers)
    seed = {
        "resources_session_id": "slow-seed-1",
        "session_key": "key-of-the-slow-seed-1",  # the retry's proof, as the client sends it
        "options": {"start_seconds": 1.0},
    }
    connection, _ = await send_unanswered(server.url, "/seed_session", seed)
    await leave(connection, after=0.3)
    # The retry waits for the seed in flight, then gets its reply: the hook ran once.
    status, headers, reply = await call(server.url, "POST", "/seed_session", seed)
    assert status == 200 and reply["resources_session_id"] == "slow-seed-1", reply
    status, _, tally = await call(server.url, "POST", "/tally", {}, cookie_of(headers))
    assert (status, tally["starts"]) == (200, 1), tally


@pytest.mark.parametrize("workers", WORKER_COUNTS)
async def test_a_step_whose_client_leaves_completes_and_is_recorded_once(serve, workers):
    server = serve(SLOW_ENV, "--debug-worker-header", workers=workers)
    cookie, holder = await start(server.url, "slow-step-1", {"step_seconds": 1.5})
    connection, _ = await send_unanswered(
        server.url, "/step", {"action": 3}, cookie, avoid_worker=holder if workers > 1 else None
    )
    await leave(connection, after=0.3)
    # The step could not be interrupted: it ran to its end and counts, once.
    status, _, observed = await call(server.url, "POST", "/observe", {}, cookie)
    assert (status, observed) == (200, {"observation": 3, "episode_length": 1})
    status, _, stepped = await call(server.url, "POST", "/step", {"action": 2}, cookie)
    assert (status, stepped["observation"]) == (200, 5), stepped
    status, _, observed = await call(server.url, "POST", "/observe", {}, cookie)
    assert observed == {"observation": 5, "episode_length": 2}


@pytest.mark.parametrize("workers", WORKER_COUNTS)
async def test_a_run_whose_client_leaves_closes_its_env_session(serve, workers):
    env = serve(SLOW_ENV)  # one worker: its /health counts every session
    agent = serve(AGENT, "--allow-env", env.url, workers=workers)
    run = {"env_url": env.url, "actions": [1] * 40, "options": {"step_seconds": 0.25}}

    async def env_sessions() -> int:
        _, _, health = await call(env.url, "GET", "/health")
        return health["sessions"]

    connection, _ = await send_unanswered(agent.url, "/run", run)
    assert await eventually(lambda: _count_is(env_sessions, 1), 10) is True  # the run plays
    await leave(connection, after=0.5)
    # Played to its end the run would take 10 s; cancelled, its finally closes the session.
    assert await eventually(lambda: _count_is(env_sessions, 0), 4) is True
    _, _, health = await call(env.url, "GET", "/health")
    assert health["open_sessions"] == 0, health
    # The agent serves on.
    short = {**run, "actions": [1, 1], "options": {"step_seconds": 0}}
    status, _, reply = await call(agent.url, "POST", "/run", short)
    assert (status, reply["episode_length"]) == (200, 2), reply


async def _count_is(count: Any, expected: int) -> bool:
    return await count() == expected
