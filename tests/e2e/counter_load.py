"""Concurrent counter episodes against a real server, every request on a new connection."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import uuid
from dataclasses import dataclass, field

import aiohttp


@dataclass
class Episode:
    session_id: str
    initial: int
    increments: list[int]
    reward: float | None = None
    statuses: list[int] = field(default_factory=list)
    error_codes: list[str] = field(default_factory=list)

    @property
    def expected(self) -> int:
        return self.initial + sum(self.increments)


def make_episodes(n: int, seed: int = 0) -> list[Episode]:
    rng = random.Random(seed)
    return [
        Episode(
            uuid.uuid4().hex,
            rng.randint(-50, 50),
            [rng.choice([i for i in range(-10, 11) if i]) for _ in range(rng.randint(3, 6))],
        )
        for _ in range(n)
    ]


def fresh_connections() -> aiohttp.ClientSession:
    # force_close: a new TCP connection for every request, so uvicorn hands each
    # request to whichever worker accepts it.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=64),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def _post(client, url, path, body, cookie, episode, headers=None):
    hdrs = dict(headers or {})
    if cookie:
        hdrs["Cookie"] = f"gym_session={cookie}"
    async with client.post(url + path, json=body, headers=hdrs) as reply:
        data = await reply.json(content_type=None)
        episode.statuses.append(reply.status)
        if reply.status >= 400:
            episode.error_codes.append(data["error"]["code"])
        for value in reply.headers.getall("set-cookie", []):
            name, _, rest = value.partition("=")
            if name == "gym_session":
                cookie = rest.split(";", 1)[0]
        return reply.status, data, cookie


async def play(client, url: str, episode: Episode, *, typed: bool = True) -> Episode:
    """Reset, step every increment, verify (close follows), close."""
    body = {"options": {"initial_count": episode.initial, "expected_count": episode.expected}}
    if typed:
        body["resources_session_id"] = episode.session_id
    status, data, cookie = await _post(client, url, "/reset", body, None, episode)
    if status != 200:
        return episode
    episode.session_id = data["resources_session_id"]
    for step in episode.increments:
        await _post(client, url, "/step", {"action": step}, cookie, episode)
    status, data, cookie = await _post(
        client, url, "/verify", {}, cookie, episode, {"x-gym-close-follows": "1"}
    )
    if status == 200:
        episode.reward = data["reward"]
    await _post(
        client, url, "/close_session", {"resources_session_id": episode.session_id}, cookie, episode
    )
    return episode


async def play_all(url: str, episodes: list[Episode], **kw) -> list[Episode]:
    async with fresh_connections() as client:
        return await asyncio.gather(*[play(client, url, e, **kw) for e in episodes])


def claim_owner(runtime_dir: str, session_id: str) -> str | None:
    path = os.path.join(runtime_dir, "claims", hashlib.sha256(session_id.encode()).hexdigest())
    try:
        with open(path) as file:
            return file.read()
    except FileNotFoundError:
        return None
