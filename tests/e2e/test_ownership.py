"""Issue 13: a session belongs to whoever started it (real servers at 4 workers).

What reaches a session:

1. its cookie (``gym_session``), on every route;
2. its MCP token (``X-Gym-Session-Token``), on MCP tool calls only (403
   ``forbidden`` elsewhere); the token is opaque and may carry a tool allow-list;
3. never the session id alone: a typed start or close naming an open or
   closed session without its cookie is 409 ``session_conflict``, changes
   nothing, sets no cookie and carries no token;
4. on a typed start or close without the cookie, the ``session_key`` the
   session was started with (16-256 characters);
5. nothing of an earlier incarnation of a reused id (cookie: 409, token: 401);
6. with ``--trust-session-ids``, the id alone again.

Every attack runs beside an honest episode: the victim keeps stepping with its
own cookie (each request on a new connection, so it lands on any worker), its
count must continue exactly and its ``/verify`` must score 1.0. Attackers use a
new connection per request too, so they reach the holder and the other workers.
The stock clients (``gymnasium.make``, ``AsyncRemoteEnv``, ``make_vec``) must keep
working at 4 workers, and send a ``session_key`` by themselves.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import http.client
import json
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import gymnasium
import numpy as np
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv
from gym_sessions.server.process import ServerProcess, start_server
from tests.replies import TOKEN, Reply, post

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
WORKERS = 4
#: Copies of each attacking request, each on a new connection (so some land on
#: the worker holding the session and some on the others).
ATTACKS = 8
INITIAL = 1000
#: The honest episode's increments: 3 before the attack, 3 during it, 2 after.
INCREMENTS = (2, 3, -1, 4, 1, -2, 5, 1)
EXPECTED = INITIAL + sum(INCREMENTS)
HIJACK = {"initial_count": -5, "expected_count": -5}
TYPED_STARTS = ("/reset", "/seed_session", "/rollouts/x/reset")


# ----------------------------------------------------------------------------- servers


def _server(*args: str) -> Iterator[ServerProcess]:
    tmp = tempfile.mkdtemp(prefix="gs-own-", dir="/tmp")
    server = start_server(COUNTER, *args, workers=WORKERS, tmpdir=os.path.join(tmp, "s"))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """The counter at 4 workers; a long window, so closed ids stay remembered."""
    yield from _server("--window", "300")


@pytest.fixture(scope="module")
def short_window_server() -> Iterator[ServerProcess]:
    """The counter at 4 workers with a 1 s window, so ids can be reused within a test."""
    yield from _server("--window", "1")


@pytest.fixture(scope="module")
def trusting_server() -> Iterator[ServerProcess]:
    """The counter at 4 workers with ``--trust-session-ids``."""
    yield from _server("--window", "300", "--trust-session-ids")


# ----------------------------------------------------------------------------- HTTP helpers


async def many(make: Callable[[], Awaitable[Reply]], copies: int = ATTACKS) -> list[Reply]:
    """``copies`` concurrent requests, each on its own new connection."""
    return list(await asyncio.gather(*(make() for _ in range(copies))))


def rpc(method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return rpc("tools/call", {"name": name, "arguments": arguments})


def new_id(label: str) -> str:
    return f"own-{label}-{uuid.uuid4().hex}"


def new_key() -> str:
    return "key-" + uuid.uuid4().hex + uuid.uuid4().hex


def assert_no_credentials(reply: Reply, *tokens: str, owner: bool = False) -> None:
    """No cookie set and no MCP token (nor the header that would carry one) in the body.

    ``owner``: the request came from the session's owner (it brought the key, or
    named a fresh id), so a cookie in the reply would be no leak: not checked.
    """
    if not owner:
        assert reply.set_cookies == [], f"the reply set a cookie: {reply.describe()}"
    assert reply.token is None, f"the reply carries a token: {reply.describe()}"
    body = reply.json
    assert not (isinstance(body, dict) and "mcp" in body), reply.describe()
    assert TOKEN.lower() not in reply.text.lower(), reply.describe()
    for token in tokens:
        assert token not in reply.text, f"the reply carries a known token: {reply.describe()}"


def assert_refused(
    replies: list[Reply], status: int, code: str, *tokens: str, owner: bool = False
) -> None:
    """Every reply is the error ``status``/``code``, with no cookie and no token."""
    for reply in replies:
        assert (reply.status, reply.code) == (status, code), (
            f"expected {status} {code}, got {reply.describe()}"
        )
        assert_no_credentials(reply, *tokens, owner=owner)


def assert_framework_error(
    replies: list[Reply], status: int, code: str, *tokens: str, owner: bool = False
) -> None:
    """As `assert_refused`, and the body is exactly ``{"error": {code, message}}``."""
    assert_refused(replies, status, code, *tokens, owner=owner)
    for reply in replies:
        assert set(reply.json) == {"error"}, reply.describe()


# ----------------------------------------------------------------------------- the honest episode


@dataclass
class Honest:
    """A victim episode played with its own cookie, every request on a new connection."""

    web: aiohttp.ClientSession
    url: str
    session_id: str
    key: str | None = None
    cookie: str = ""
    token: str = ""
    #: (increment, status, observation) of every step taken so far.
    log: list[tuple[int, int, Any]] = field(default_factory=list)

    async def start(self, path: str = "/reset", **extra: Any) -> Reply:
        body: dict[str, Any] = {
            "resources_session_id": self.session_id,
            "options": {"initial_count": INITIAL, "expected_count": EXPECTED},
            **extra,
        }
        if self.key is not None:
            body["session_key"] = self.key
        reply = await post(self.web, self.url + path, body)
        assert reply.status == 200, reply.describe()
        assert reply.json["resources_session_id"] == self.session_id
        assert reply.json["observation"] == INITIAL
        assert reply.cookie, reply.describe()
        assert reply.token, reply.describe()
        self.cookie, self.token = reply.cookie, reply.token
        return reply

    async def play(self, steps: int) -> None:
        for _ in range(steps):
            increment = INCREMENTS[len(self.log)]
            reply = await post(
                self.web, self.url + "/step", {"action": increment}, cookie=self.cookie
            )
            observation = reply.json.get("observation") if reply.status == 200 else reply.text
            self.log.append((increment, reply.status, observation))
            await asyncio.sleep(0.01)

    async def check_untouched(self) -> None:
        """Every step so far continued the count exactly; ``/observe`` agrees."""
        count = INITIAL
        for index, (increment, status, observation) in enumerate(self.log):
            count += increment
            assert (status, observation) == (200, count), (
                f"the victim's step {index + 1} got {status} {observation!r}, expected the count "
                f"{count}: its session was changed by someone else (steps: {self.log})"
            )
        reply = await post(self.web, self.url + "/observe", {}, cookie=self.cookie)
        assert reply.status == 200, reply.describe()
        assert reply.json == {"observation": count, "episode_length": len(self.log)}

    async def finish(self) -> None:
        """Play the remaining steps, check the count, and score 1.0 on ``/verify``."""
        await self.play(len(INCREMENTS) - len(self.log))
        await self.check_untouched()
        reply = await post(self.web, self.url + "/verify", {}, cookie=self.cookie)
        assert reply.status == 200, reply.describe()
        assert reply.json["reward"] == 1.0, reply.describe()


async def beside(victim: Honest, attack: Callable[[], Awaitable[list[Reply]]]) -> list[Reply]:
    """Run ``attack`` in the middle of the victim's episode, concurrently with its steps."""
    await victim.play(3)
    replies, _ = await asyncio.gather(attack(), victim.play(3))
    await victim.play(2)
    return replies


async def started(web: aiohttp.ClientSession, url: str, label: str, key: str | None = None):
    victim = Honest(web, url, new_id(label), key)
    await victim.start()
    return victim


# ----------------------------------------------------------------------------- 1. the cookie


async def test_cookie_reaches_every_route_of_its_own_session(server, web):
    victim = await started(web, server.url, "cookie")
    url, cookie, sid = server.url, victim.cookie, victim.session_id
    step = await post(web, url + "/step", {"action": 4}, cookie=cookie)
    assert (step.status, step.json["observation"]) == (200, INITIAL + 4), step.describe()
    step = await post(web, url + "/rollouts/r1/step", {"action": 1}, cookie=cookie)
    assert (step.status, step.json["observation"]) == (200, INITIAL + 5), step.describe()
    observed = await post(web, url + "/observe", {}, cookie=cookie)
    assert observed.json == {"observation": INITIAL + 5, "episode_length": 2}
    # Typed resets with the cookie (naming the same id, or none) restart the episode.
    for path, body in (
        ("/reset", {"resources_session_id": sid, "options": {"initial_count": 7}}),
        ("/reset", {"options": {"initial_count": 8}}),
        ("/rollouts/r2/reset", {"resources_session_id": sid, "options": {"initial_count": 9}}),
    ):
        reply = await post(web, url + path, body, cookie=cookie)
        assert reply.status == 200, f"{path}: {reply.describe()}"
        assert reply.json["resources_session_id"] == sid
        assert reply.json["observation"] == body["options"]["initial_count"]
        assert reply.token
    # A seed with the cookie never restarts an open session: the body of the start
    # that opened this episode gets that start's reply again; another body is 409.
    again = await post(web, url + "/seed_session", {"options": {"initial_count": 9}}, cookie=cookie)
    assert (again.status, again.json) == (200, reply.json), again.describe()
    other = await post(web, url + "/seed_session", {"options": {"initial_count": 8}}, cookie=cookie)
    assert (other.status, other.code) == (409, "session_conflict"), other.describe()
    verified = await post(
        web, url + "/verify", {}, cookie=cookie, headers={"x-gym-close-follows": "1"}
    )
    assert verified.status == 200, verified.describe()
    closed = await post(web, url + "/close_session", {"resources_session_id": sid}, cookie=cookie)
    assert (closed.status, closed.json["outcome"]) == (200, "closed"), closed.describe()


# ----------------------------------------------------------------------------- 2. the MCP token


async def test_token_reaches_mcp_tool_calls_of_its_own_session(server, web):
    victim = await started(web, server.url, "mcp")
    mcp = server.url + "/mcp"
    listed = await post(web, mcp, rpc("tools/list"), token=victim.token)
    assert listed.status == 200, listed.describe()
    assert {tool["name"] for tool in listed.json["result"]["tools"]} == {"step", "observe"}
    for expected, action in ((INITIAL + 3, 3), (INITIAL + 1, -2)):
        called = await post(web, mcp, tool_call("step", {"action": action}), token=victim.token)
        assert called.status == 200, called.describe()
        assert called.json["result"]["isError"] is False, called.describe()
        assert called.json["result"]["structuredContent"]["observation"] == expected
    observed = await post(web, mcp, tool_call("observe", {}), token=victim.token)
    assert observed.json["result"]["structuredContent"] == {
        "observation": INITIAL + 1,
        "episode_length": 2,
    }
    # The cookie sees the same session.
    by_cookie = await post(web, server.url + "/observe", {}, cookie=victim.cookie)
    assert by_cookie.json == {"observation": INITIAL + 1, "episode_length": 2}


TOKEN_ONLY_REQUESTS = {
    "/reset": {"options": HIJACK},
    "/seed_session": {"options": HIJACK},
    "/verify": {},
    "/close_session": {},
    "/step": {"action": 10},
    "/observe": {},
}


@pytest.mark.parametrize("path", list(TOKEN_ONLY_REQUESTS))
async def test_token_alone_is_forbidden_outside_mcp(server, web, path):
    victim = await started(web, server.url, "token-only")

    async def attack() -> list[Reply]:
        return await many(
            lambda: post(web, server.url + path, TOKEN_ONLY_REQUESTS[path], token=victim.token)
        )

    replies = await beside(victim, attack)
    assert_framework_error(replies, 403, "forbidden", victim.token)
    await victim.finish()


def _base64_decodings(text: str) -> list[bytes]:
    """Every base64 / base64url reading of ``text`` (and zlib inflations of them)."""
    decoded: list[bytes] = []
    padded = text + "=" * (-len(text) % 4)
    readings = [(candidate, altchars) for candidate in (text, padded) for altchars in (None, b"-_")]
    for candidate, altchars in readings:
        with contextlib.suppress(binascii.Error, ValueError):
            decoded.append(base64.b64decode(candidate, altchars=altchars))
    for raw in list(decoded):
        with contextlib.suppress(zlib.error):
            decoded.append(zlib.decompress(raw))
    return decoded


def _readable_json(raw: bytes) -> bool:
    try:
        json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


async def test_token_is_opaque(server, web):
    victim = await started(web, server.url, "opaque")
    token, sid = victim.token, victim.session_id
    assert sid not in token
    parts = [part for part in token.split(".") if part]
    assert parts, token
    for part in [token, *parts]:
        for raw in _base64_decodings(part):
            assert sid.encode() not in raw, f"the session id is readable in the token: {raw!r}"
            assert not _readable_json(raw), f"the token carries readable JSON: {raw!r}"
    await victim.finish()


async def test_mcp_tools_allow_list_limits_listing_and_calls(server, web):
    victim = Honest(web, server.url, new_id("allow-list"))
    await victim.start(mcp_tools=["observe"])
    mcp = server.url + "/mcp"
    listed = await post(web, mcp, rpc("tools/list"), token=victim.token)
    assert listed.status == 200, listed.describe()
    assert [tool["name"] for tool in listed.json["result"]["tools"]] == ["observe"]

    refused = await many(
        lambda: post(web, mcp, tool_call("step", {"action": 10}), token=victim.token)
    )
    for reply in refused:
        body = reply.json
        assert isinstance(body, dict) and "result" not in body, reply.describe()
        assert "unknown tool" in body["error"]["message"], reply.describe()
        assert reply.set_cookies == []
    observed = await post(web, mcp, tool_call("observe", {}), token=victim.token)
    assert observed.json["result"]["structuredContent"] == {
        "observation": INITIAL,
        "episode_length": 0,
    }
    # The cookie still reaches every route; the refused calls changed nothing.
    await victim.finish()


async def test_unknown_tool_in_the_allow_list_is_an_invalid_request(server, web):
    for path in ("/reset", "/seed_session"):
        body = {
            "resources_session_id": new_id("bad-allow-list"),
            "options": {"initial_count": 1},
            "mcp_tools": ["observe", "fly"],
        }
        reply = await post(web, server.url + path, body)
        assert_framework_error([reply], 400, "invalid_request", owner=True)


# ----------------------------------------------------------------------------- 3. the id alone


@pytest.mark.parametrize("path", [*TYPED_STARTS, "/close_session"])
async def test_the_id_alone_does_not_reach_an_open_session(server, web, path):
    victim = await started(web, server.url, "id-alone")
    body: dict[str, Any] = {"resources_session_id": victim.session_id}
    if path != "/close_session":
        body["options"] = HIJACK

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, server.url + path, body))

    replies = await beside(victim, attack)
    assert_framework_error(replies, 409, "session_conflict", victim.token)
    await victim.finish()


async def test_the_id_alone_does_not_reach_a_closed_session(server, web):
    closed = await started(web, server.url, "closed")
    await closed.play(2)
    reply = await post(
        web,
        server.url + "/close_session",
        {"resources_session_id": closed.session_id},
        cookie=closed.cookie,
    )
    assert (reply.status, reply.json["outcome"]) == (200, "closed"), reply.describe()
    bystander = await started(web, server.url, "bystander")
    sid = closed.session_id

    async def attack() -> list[Reply]:
        close = many(
            lambda: post(web, server.url + "/close_session", {"resources_session_id": sid})
        )
        starts = [
            many(
                lambda path=path: post(
                    web, server.url + path, {"resources_session_id": sid, "options": HIJACK}
                ),
                copies=3,
            )
            for path in TYPED_STARTS
        ]
        results = await asyncio.gather(close, *starts)
        return [reply for replies in results for reply in replies]

    replies = await beside(bystander, attack)
    # Closes first: today a stranger's close of a closed id gets its receipt.
    assert_framework_error(replies, 409, "session_conflict", closed.token)
    await bystander.finish()
    # The owner still gets its receipt, and the session stays closed.
    again = await post(
        web, server.url + "/close_session", {"resources_session_id": sid}, cookie=closed.cookie
    )
    assert (again.status, again.json["outcome"]) == (200, "already_closed"), again.describe()
    step = await post(web, server.url + "/step", {"action": 1}, cookie=closed.cookie)
    assert step.status == 409, step.describe()


# ----------------------------------------------------------------------------- 4. session_key


async def test_retried_start_with_the_key_restarts_and_returns_credentials(server, web):
    """A start whose reply was lost is sent again without a cookie but with the key."""
    key = new_key()
    first = await started(web, server.url, "retry", key)
    await first.play(2)
    body = {
        "resources_session_id": first.session_id,
        "session_key": key,
        "options": {"initial_count": 50, "expected_count": 51},
    }
    retried = await post(web, server.url + "/reset", body)
    assert retried.status == 200, retried.describe()
    assert retried.json["observation"] == 50
    assert retried.cookie and retried.token, retried.describe()
    observed = await post(web, server.url + "/observe", {}, cookie=retried.cookie)
    assert observed.json == {"observation": 50, "episode_length": 0}, observed.describe()
    called = await post(
        web, server.url + "/mcp", tool_call("step", {"action": 1}), token=retried.token
    )
    assert called.json["result"]["structuredContent"]["observation"] == 51, called.describe()
    verified = await post(web, server.url + "/verify", {}, cookie=retried.cookie)
    assert verified.json["reward"] == 1.0, verified.describe()


async def test_cleanup_close_with_only_the_key_closes(server, web):
    key = new_key()
    victim = await started(web, server.url, "cleanup", key)
    await victim.play(2)
    body = {"resources_session_id": victim.session_id, "session_key": key}
    closed = await post(web, server.url + "/close_session", body)
    assert (closed.status, closed.json.get("outcome")) == (200, "closed"), closed.describe()
    step = await post(web, server.url + "/step", {"action": 1}, cookie=victim.cookie)
    assert step.status == 409, step.describe()
    again = await post(web, server.url + "/close_session", body)
    assert (again.status, again.json.get("outcome")) == (200, "already_closed"), again.describe()


@pytest.mark.parametrize("path", [*TYPED_STARTS, "/close_session"])
async def test_a_wrong_key_is_refused(server, web, path):
    victim = await started(web, server.url, "wrong-key", new_key())
    body: dict[str, Any] = {"resources_session_id": victim.session_id, "session_key": new_key()}
    if path != "/close_session":
        body["options"] = HIJACK

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, server.url + path, body))

    replies = await beside(victim, attack)
    assert_framework_error(replies, 409, "session_conflict", victim.token)
    await victim.finish()


@pytest.mark.parametrize("path", [*TYPED_STARTS, "/close_session"])
async def test_a_key_does_not_reach_a_session_started_without_one(server, web, path):
    victim = await started(web, server.url, "keyless")
    body: dict[str, Any] = {"resources_session_id": victim.session_id, "session_key": new_key()}
    if path != "/close_session":
        body["options"] = HIJACK

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, server.url + path, body))

    replies = await beside(victim, attack)
    assert_framework_error(replies, 409, "session_conflict", victim.token)
    await victim.finish()


BAD_KEYS = {
    "15 characters": "k" * 15,
    "257 characters": "k" * 257,
    "an integer": 1234567890123456789,
    "a list": ["k" * 20],
}


@pytest.mark.parametrize("bad_key", list(BAD_KEYS))
@pytest.mark.parametrize("path", ["/reset", "/seed_session", "/close_session"])
async def test_a_malformed_key_is_an_invalid_request(server, web, path, bad_key):
    victim = await started(web, server.url, "bad-key", new_key())
    body: dict[str, Any] = {
        "resources_session_id": victim.session_id,
        "session_key": BAD_KEYS[bad_key],
    }
    if path != "/close_session":
        body["options"] = HIJACK

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, server.url + path, body), copies=4)

    replies = await beside(victim, attack)
    assert_framework_error(replies, 400, "invalid_request", victim.token)
    await victim.finish()


@pytest.mark.parametrize("length", [16, 256])
async def test_keys_of_16_and_256_characters_are_accepted(server, web, length):
    key = "k" * length
    victim = await started(web, server.url, f"key-{length}", key)
    retried = await post(
        web,
        server.url + "/seed_session",
        {
            "resources_session_id": victim.session_id,
            "session_key": key,
            "options": {"initial_count": INITIAL, "expected_count": EXPECTED},
        },
    )
    assert retried.status == 200 and retried.cookie and retried.token, retried.describe()
    victim.cookie = retried.cookie
    await victim.finish()


async def test_a_close_with_a_key_before_the_start_refuses_that_start(server, web):
    sid, key = new_id("close-first"), new_key()
    closed = await post(
        web, server.url + "/close_session", {"resources_session_id": sid, "session_key": key}
    )
    assert closed.status == 200, closed.describe()
    late = await post(
        web,
        server.url + "/reset",
        {"resources_session_id": sid, "session_key": key, "options": {"initial_count": 1}},
    )
    assert_framework_error([late], 409, "session_closed", owner=True)
    stranger = await many(
        lambda: post(web, server.url + "/reset", {"resources_session_id": sid}), copies=4
    )
    assert_framework_error(stranger, 409, "session_conflict")


# ----------------------------------------------------------------------------- 5. incarnations


async def test_credentials_of_an_earlier_incarnation_reach_nothing(short_window_server, web):
    url = short_window_server.url
    sid, kx, kv = new_id("reused"), new_key(), new_key()
    earlier = Honest(web, url, sid, kx)
    await earlier.start()
    await earlier.play(2)
    closed = await post(
        web, url + "/close_session", {"resources_session_id": sid}, cookie=earlier.cookie
    )
    assert (closed.status, closed.json["outcome"]) == (200, "closed"), closed.describe()

    # The window passes: V's start of the same id stops being refused (bounded polling;
    # each try is more than a window after the last request for the id).
    victim = Honest(web, url, sid, kv)
    body = {
        "resources_session_id": sid,
        "session_key": kv,
        "options": {"initial_count": INITIAL, "expected_count": EXPECTED},
    }
    deadline = time.monotonic() + 10
    while True:
        await asyncio.sleep(1.25)
        reply = await post(web, url + "/reset", body)
        if reply.status != 409 or time.monotonic() > deadline:
            break
    assert reply.status == 200 and reply.cookie and reply.token, reply.describe()
    victim.cookie, victim.token = reply.cookie, reply.token

    async def attack() -> list[Reply]:
        cookie_steps = many(
            lambda: post(web, url + "/step", {"action": 10}, cookie=earlier.cookie), copies=4
        )
        token_calls = many(
            lambda: post(web, url + "/mcp", tool_call("step", {"action": 10}), token=earlier.token),
            copies=4,
        )
        key_starts = many(
            lambda: post(
                web,
                url + "/reset",
                {"resources_session_id": sid, "session_key": kx, "options": HIJACK},
            ),
            copies=4,
        )
        return [r for rs in await asyncio.gather(cookie_steps, token_calls, key_starts) for r in rs]

    replies = await beside(victim, attack)
    cookie_steps, token_calls, key_starts = replies[:4], replies[4:8], replies[8:]
    assert_framework_error(cookie_steps, 409, "session_conflict", victim.token)
    for call in token_calls:
        assert call.status == 401, call.describe()
        assert call.code == "invalid_token", call.describe()
        assert "result" not in call.json, call.describe()
        assert_no_credentials(call, victim.token)
    assert_framework_error(key_starts, 409, "session_conflict", victim.token)
    await victim.finish()


# ----------------------------------------------------------------------------- 6. trusted ids


async def test_trust_session_ids_lets_the_id_alone_start_and_close(trusting_server, web):
    url = trusting_server.url
    victim = await started(web, url, "trusted")
    await victim.play(2)
    restarted = await post(
        web,
        url + "/reset",
        {"resources_session_id": victim.session_id, "options": {"initial_count": 70}},
    )
    assert restarted.status == 200 and restarted.cookie and restarted.token, restarted.describe()
    observed = await post(web, url + "/observe", {}, cookie=victim.cookie)
    assert observed.json == {"observation": 70, "episode_length": 0}, observed.describe()
    closed = await post(web, url + "/close_session", {"resources_session_id": victim.session_id})
    assert (closed.status, closed.json["outcome"]) == (200, "closed"), closed.describe()
    step = await post(web, url + "/step", {"action": 1}, cookie=victim.cookie)
    assert step.status == 409, step.describe()


# ----------------------------------------------------------------------------- 8. stock clients


def _play_remote_env(url: str, initial: int, keep_alive: bool) -> float:
    env = gymnasium.make("gym_sessions/Remote-v0", url=url, keep_alive=keep_alive)
    try:
        increments = [3, -4, 7, 1]
        expected = initial + sum(increments)
        for episode in range(2):  # the second reset restarts the same session
            obs, _ = env.reset(options={"initial_count": initial, "expected_count": expected})
            assert int(obs) == initial, episode
            count = initial
            for increment in increments:
                obs, *_ = env.step(increment)
                count += increment
                assert int(obs) == count
        return env.unwrapped.verify()["reward"]
    finally:
        env.close()


@pytest.mark.parametrize("keep_alive", [True, False])
def test_gymnasium_make_remote_env_finishes_episodes_at_4_workers(server, keep_alive):
    with ThreadPoolExecutor(8) as pool:
        rewards = list(
            pool.map(lambda i: _play_remote_env(server.url, 10 * i, keep_alive), range(8))
        )
    assert rewards == [1.0] * 8


async def test_async_remote_env_finishes_concurrent_episodes_at_4_workers(server):
    async def play(initial: int) -> float:
        async with AsyncRemoteEnv(server.url) as env:
            expected = initial + 6
            obs, _ = await env.reset(options={"initial_count": initial, "expected_count": expected})
            assert int(obs) == initial
            for step in (1, 2, 3):
                obs, *_ = await env.step(step)
            assert int(obs) == expected
            return (await env.verify())["reward"]

    assert await asyncio.gather(*(play(i) for i in range(16))) == [1.0] * 16


def test_make_vec_keeps_working_at_4_workers(server):
    envs = gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=4, url=server.url)
    try:
        obs, _ = envs.reset(options={"initial_count": 5})
        assert obs.tolist() == [5, 5, 5, 5]
        actions = np.array([1, -1, 2, -2])
        for step in range(1, 4):
            obs, *_ = envs.step(actions)
            assert obs.tolist() == (5 + step * actions).tolist()
        assert len(set(envs.unwrapped.session_ids)) == 4
    finally:
        envs.close()


class _RecordingProxy:
    """An HTTP proxy that records request bodies and drops the first ``/reset`` reply.

    Each forwarded request uses a new connection to the server (so it lands on any
    worker); the dropped reply's connection is closed without an answer, as when a
    reply is lost, so the client resends the start without the cookie it never got.
    """

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.requests: list[tuple[str, str, bool, bytes]] = []
        self.dropped = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy.requests.append((self.command, self.path, "cookie" in self.headers, body))
                    drop = self.path.endswith("/reset") and proxy.dropped == 0
                    if drop:
                        proxy.dropped += 1
                headers = {
                    name: value
                    for name, value in self.headers.items()
                    if name.lower() not in {"host", "connection", "content-length", "keep-alive"}
                }
                upstream = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=headers)
                    reply = upstream.getresponse()
                    data = reply.read()
                finally:
                    upstream.close()
                if drop:  # the server ran the start; its reply never reaches the client
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                self.send_response(reply.status)
                for name, value in reply.getheaders():
                    if name.lower() not in {
                        "content-length",
                        "connection",
                        "transfer-encoding",
                        "date",
                        "server",
                    }:
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = _forward
            do_POST = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset_bodies(self) -> list[tuple[bool, dict[str, Any]]]:
        """(sent with a cookie, body) of every ``/reset`` the client sent."""
        with self._lock:
            return [
                (has_cookie, json.loads(body))
                for method, path, has_cookie, body in self.requests
                if method == "POST" and path.endswith("/reset")
            ]


def _check_reset_keys(proxy: _RecordingProxy) -> str:
    resets = proxy.reset_bodies()
    assert proxy.dropped == 1
    assert len(resets) == 2, resets  # the start and its resend
    (first_cookie, first), (second_cookie, second) = resets
    assert not first_cookie and not second_cookie  # the resend had no cookie to send
    key = first.get("session_key")
    assert isinstance(key, str) and 16 <= len(key) <= 256, f"no session_key sent: {first}"
    assert second.get("session_key") == key, "the resent start must bring the same key"
    assert second["resources_session_id"] == first["resources_session_id"]
    return key


def test_remote_env_resends_a_lost_start_with_its_key(server):
    keys = []
    for _ in range(2):
        proxy = _RecordingProxy(server.url)
        try:
            env = gymnasium.make("gym_sessions/Remote-v0", url=proxy.url)
            try:
                obs, _ = env.reset(options={"initial_count": 20, "expected_count": 23})
                assert int(obs) == 20
                obs, *_ = env.step(3)
                assert int(obs) == 23
                assert env.unwrapped.verify()["reward"] == 1.0
            finally:
                env.close()
            keys.append(_check_reset_keys(proxy))
        finally:
            proxy.close()
    assert keys[0] != keys[1], "each session needs its own random key"


async def test_async_remote_env_resends_a_lost_start_with_its_key(server):
    proxy = _RecordingProxy(server.url)
    try:
        async with AsyncRemoteEnv(proxy.url) as env:
            obs, _ = await env.reset(options={"initial_count": 30, "expected_count": 28})
            assert int(obs) == 30
            obs, *_ = await env.step(-2)
            assert int(obs) == 28
            assert (await env.verify())["reward"] == 1.0
        await asyncio.to_thread(_check_reset_keys, proxy)
    finally:
        await asyncio.to_thread(proxy.close)
