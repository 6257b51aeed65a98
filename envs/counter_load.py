"""Counter episodes over raw HTTP, for tests, benchmarks and stress runs.

`play_all` runs episodes concurrently against a served `CounterEnv`, with a new
TCP connection for every request by default, so uvicorn hands each request to
whichever worker accepts it: the case session routing exists for.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gym_sessions.wire import CLOSE_FOLLOWS_HEADER, DEBUG_WORKER_HEADER, SESSION_COOKIE

__all__ = [
    "Episode",
    "client_session",
    "make_episodes",
    "play",
    "play_all",
    "play_over_mcp",
]

_WORKER = DEBUG_WORKER_HEADER


@dataclass
class Episode:
    """One counter episode and what happened to it."""

    session_id: str
    initial: int
    increments: list[int]
    reward: float | None = None
    statuses: list[int] = field(default_factory=list)
    error_codes: list[str] = field(default_factory=list)
    #: Proof of ownership sent with every start and close, as real clients do.
    session_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    #: The worker that answered each request (``x-gym-worker``: servers started
    #: with ``--debug-worker-header``; None without): the session's holder.
    served_by: list[str | None] = field(default_factory=list)

    @property
    def expected(self) -> int:
        return self.initial + sum(self.increments)

    @property
    def task(self) -> dict[str, Any]:
        """The episode as a counter task, the ``task`` of a `CounterAgent` ``/run``."""
        return {
            "initial_count": self.initial,
            "increments": self.increments,
            "expected_count": self.expected,
        }


def make_episodes(n: int, seed: int = 0) -> list[Episode]:
    """``n`` random episodes of 3-6 non-zero increments, reproducible from ``seed``."""
    rng = random.Random(seed)
    steps = [i for i in range(-10, 11) if i]
    return [
        Episode(
            uuid.UUID(int=rng.getrandbits(128)).hex,
            rng.randint(-50, 50),
            [rng.choice(steps) for _ in range(rng.randint(3, 6))],
        )
        for _ in range(n)
    ]


def client_session(*, fresh_connections: bool = True, limit: int = 64) -> aiohttp.ClientSession:
    """An aiohttp client; ``fresh_connections`` opens a new TCP connection per request."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=fresh_connections, limit=limit),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=120),
    )


async def _post(
    client: aiohttp.ClientSession,
    url: str,
    episode: Episode,
    body: dict[str, Any] | None,
    cookie: str | None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any, str | None]:
    send_headers = dict(headers or {})
    if cookie:
        send_headers["Cookie"] = f"{SESSION_COOKIE}={cookie}"
    async with client.post(url, json=body, headers=send_headers) as reply:
        data = await reply.json(content_type=None)
        episode.statuses.append(reply.status)
        episode.served_by.append(reply.headers.get(_WORKER))
        if reply.status >= 400:
            episode.error_codes.append(data["error"]["code"])
        morsel = reply.cookies.get(SESSION_COOKIE)
        return reply.status, data, morsel.value if morsel else cookie


async def play(
    client: aiohttp.ClientSession, url: str, episode: Episode, *, typed: bool = True
) -> Episode:
    """Reset, step every increment, verify (a close follows), close; records the reward.

    Args:
        typed: Name the session in the reset body; otherwise the server mints
            the id and the cookie carries it.
    """
    body: dict[str, Any] = {
        "options": {"initial_count": episode.initial, "expected_count": episode.expected},
        "session_key": episode.session_key,
    }
    if typed:
        body["resources_session_id"] = episode.session_id
    status, data, cookie = await _post(client, url + "/reset", episode, body, None)
    if status != 200:
        return episode
    episode.session_id = data["resources_session_id"]
    for step in episode.increments:
        await _post(client, url + "/step", episode, {"action": step}, cookie)
    status, data, cookie = await _post(
        client, url + "/verify", episode, {}, cookie, {CLOSE_FOLLOWS_HEADER: "1"}
    )
    if status == 200:
        episode.reward = data["reward"]
    close_body = {"resources_session_id": episode.session_id, "session_key": episode.session_key}
    await _post(client, url + "/close_session", episode, close_body, cookie)
    return episode


async def play_all(
    url: str, episodes: list[Episode], *, typed: bool = True, fresh_connections: bool = True
) -> list[Episode]:
    """Play ``episodes`` concurrently against the server at ``url``."""
    async with client_session(fresh_connections=fresh_connections) as client:
        return await asyncio.gather(*[play(client, url, e, typed=typed) for e in episodes])


async def play_over_mcp(client: aiohttp.ClientSession, url: str, episode: Episode) -> Episode:
    """Start over HTTP, then only MCP tool calls with the session token; reads the count last.

    The reward is 1.0 when the count read over MCP is the expected one.
    """
    body = {"options": {"initial_count": episode.initial}, "session_key": episode.session_key}
    status, data, _ = await _post(client, url + "/reset", episode, body, None)
    if status != 200:
        return episode
    episode.session_id = data["resources_session_id"]
    headers = data["mcp"]["headers"]
    calls = [("step", {"action": step}) for step in episode.increments] + [("observe", {})]
    result: dict[str, Any] = {}
    for index, (name, arguments) in enumerate(calls):
        call = {
            "jsonrpc": "2.0",
            "id": index,
            "method": "tools/call",
            "params": {"name": name, "arguments": arguments},
        }
        async with client.post(url + "/mcp", json=call, headers=headers) as reply:
            episode.statuses.append(reply.status)
            reply_data = await reply.json(content_type=None)
        if "error" in reply_data:
            episode.error_codes.append(str(reply_data["error"].get("code")))
        result = reply_data.get("result") or {}
    observed = (result.get("structuredContent") or {}).get("observation")
    episode.reward = 1.0 if observed == episode.expected else 0.0
    return episode
