"""Issue 13 on an agent server: an agent session belongs to whoever seeded it (4 workers).

``gym-sessions serve envs.counter_agent:CounterAgent --workers 4``: an agent session is
seeded with ``POST /v1/agent_sessions {agent_session_id, session_key?}`` (reply
with the session cookie) and closed with ``POST /v1/agent_sessions/close``
(the close receipt). A seed or close naming another client's
``agent_session_id`` without its cookie or its ``session_key`` is 409
``session_conflict``, with no cookie and no receipt. The owner closes with its
cookie, or with its key alone.

Every attack runs beside the owner's honest work: it keeps ``POST /remember``-ing
values with its own cookie (each request on a new connection), each reply must
continue its count and total exactly, and its close receipt must count them all.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from gym_sessions.server.process import ServerProcess, start_server
from tests.replies import Reply, post

pytestmark = pytest.mark.e2e

AGENT = "envs.counter_agent:CounterAgent"
SEED = "/v1/agent_sessions"
CLOSE = "/v1/agent_sessions/close"
ATTACKS = 8
#: The owner's remembered values: 3 before the attack, 3 during it, 2 after.
VALUES = (3, 1, 4, 1, 5, 9, 2, 6)


@pytest.fixture(scope="module")
def agent() -> Iterator[ServerProcess]:
    tmp = tempfile.mkdtemp(prefix="gs-own-agent-", dir="/tmp")
    server = start_server(AGENT, "--window", "300", workers=4, tmpdir=os.path.join(tmp, "s"))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


async def many(make: Callable[[], Awaitable[Reply]], copies: int = ATTACKS) -> list[Reply]:
    return list(await asyncio.gather(*(make() for _ in range(copies))))


def new_id(label: str) -> str:
    return f"own-agent-{label}-{uuid.uuid4().hex}"


def new_key() -> str:
    return "key-" + uuid.uuid4().hex + uuid.uuid4().hex


def assert_refused(replies: list[Reply], status: int, code: str) -> None:
    """Each reply is exactly the framework error, with no cookie and no receipt."""
    for reply in replies:
        assert (reply.status, reply.code) == (status, code), (
            f"expected {status} {code}, got {reply.describe()}"
        )
        assert set(reply.json) == {"error"}, reply.describe()
        assert reply.set_cookies == [], f"the reply set a cookie: {reply.describe()}"
        assert "outcome" not in reply.text, f"the reply carries a receipt: {reply.describe()}"


@dataclass
class Owner:
    """An agent session's owner, remembering values with its own cookie."""

    web: aiohttp.ClientSession
    url: str
    session_id: str
    key: str | None = None
    cookie: str = ""
    #: (value, status, reply body) of every /remember so far.
    log: list[tuple[int, int, Any]] = field(default_factory=list)

    async def seed(self) -> None:
        body: dict[str, Any] = {"agent_session_id": self.session_id}
        if self.key is not None:
            body["session_key"] = self.key
        reply = await post(self.web, self.url + SEED, body)
        assert reply.status == 200, reply.describe()
        assert reply.json == {"agent_session_id": self.session_id, "created": True}
        assert reply.cookie, reply.describe()
        self.cookie = reply.cookie

    async def remember(self, count: int) -> None:
        for _ in range(count):
            value = VALUES[len(self.log)]
            reply = await post(
                self.web, self.url + "/remember", {"value": value}, cookie=self.cookie
            )
            self.log.append((value, reply.status, reply.json))
            await asyncio.sleep(0.01)

    def check_untouched(self) -> None:
        total = 0
        for index, (value, status, body) in enumerate(self.log):
            total += value
            assert (status, body) == (200, {"count": index + 1, "total": total}), (
                f"remember {index + 1} got {status} {body!r}: the agent session was changed "
                f"by someone else (log: {self.log})"
            )

    def check_receipt(self, reply: Reply) -> None:
        assert reply.status == 200, reply.describe()
        assert reply.json == {
            "agent_session_id": self.session_id,
            "outcome": "closed",
            "count": len(VALUES),
            "total": sum(VALUES),
        }, reply.describe()

    async def finish(self, *, with_key_only: bool = False) -> None:
        """Remember the remaining values, check them, close and check the receipt."""
        await self.remember(len(VALUES) - len(self.log))
        self.check_untouched()
        if with_key_only:
            body = {"agent_session_id": self.session_id, "session_key": self.key}
            reply = await post(self.web, self.url + CLOSE, body)
        else:
            body = {"agent_session_id": self.session_id}
            reply = await post(self.web, self.url + CLOSE, body, cookie=self.cookie)
        self.check_receipt(reply)


async def beside(owner: Owner, attack: Callable[[], Awaitable[list[Reply]]]) -> list[Reply]:
    await owner.remember(3)
    replies, _ = await asyncio.gather(attack(), owner.remember(3))
    await owner.remember(2)
    return replies


async def seeded(web, url: str, label: str, key: str | None) -> Owner:
    owner = Owner(web, url, new_id(label), key)
    await owner.seed()
    return owner


STRANGER_KEYS = {"no key": None, "a wrong key": "wrong"}


@pytest.mark.parametrize("stranger", list(STRANGER_KEYS))
async def test_a_stranger_cannot_seed_anothers_agent_session(agent, web, stranger):
    owner = await seeded(web, agent.url, "seed", new_key())
    body: dict[str, Any] = {"agent_session_id": owner.session_id, "values": [100]}
    if STRANGER_KEYS[stranger] is not None:
        body["session_key"] = new_key()

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, agent.url + SEED, body))

    replies = await beside(owner, attack)
    assert_refused(replies, 409, "session_conflict")
    await owner.finish()


@pytest.mark.parametrize("stranger", list(STRANGER_KEYS))
async def test_a_stranger_cannot_close_anothers_agent_session(agent, web, stranger):
    owner = await seeded(web, agent.url, "close", new_key())
    body: dict[str, Any] = {"agent_session_id": owner.session_id}
    if STRANGER_KEYS[stranger] is not None:
        body["session_key"] = new_key()

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, agent.url + CLOSE, body))

    replies = await beside(owner, attack)
    assert_refused(replies, 409, "session_conflict")
    await owner.finish()


async def test_a_key_does_not_reach_an_agent_session_seeded_without_one(agent, web):
    owner = await seeded(web, agent.url, "keyless", None)
    sid = owner.session_id

    async def attack() -> list[Reply]:
        seeds = many(
            lambda: post(web, agent.url + SEED, {"agent_session_id": sid, "session_key": new_key()})
        )
        closes = many(
            lambda: post(
                web, agent.url + CLOSE, {"agent_session_id": sid, "session_key": new_key()}
            )
        )
        return [reply for replies in await asyncio.gather(seeds, closes) for reply in replies]

    replies = await beside(owner, attack)
    assert_refused(replies, 409, "session_conflict")
    await owner.finish()


async def test_the_owner_closes_with_its_key_alone(agent, web):
    owner = await seeded(web, agent.url, "key-close", new_key())
    await owner.finish(with_key_only=True)
    # A retried close with the key gets the same receipt; the cookie too.
    body = {"agent_session_id": owner.session_id, "session_key": owner.key}
    owner.check_receipt(await post(web, agent.url + CLOSE, body))
    by_cookie = await post(
        web, agent.url + CLOSE, {"agent_session_id": owner.session_id}, cookie=owner.cookie
    )
    owner.check_receipt(by_cookie)


async def test_the_owner_retries_a_seed_with_its_key(agent, web):
    """A seed whose reply was lost is sent again without a cookie but with the key."""
    owner = await seeded(web, agent.url, "retry", new_key())
    await owner.remember(2)
    retried = await post(
        web, agent.url + SEED, {"agent_session_id": owner.session_id, "session_key": owner.key}
    )
    assert retried.status == 200, retried.describe()
    assert retried.json == {"agent_session_id": owner.session_id, "created": False}
    assert retried.cookie, retried.describe()
    owner.cookie = retried.cookie
    await owner.finish()


async def test_a_stranger_cannot_close_a_closed_agent_session(agent, web):
    owner = await seeded(web, agent.url, "closed", new_key())
    await owner.finish()
    bystander = await seeded(web, agent.url, "bystander", new_key())
    sid = owner.session_id

    async def attack() -> list[Reply]:
        closes = many(lambda: post(web, agent.url + CLOSE, {"agent_session_id": sid}))
        seeds = many(lambda: post(web, agent.url + SEED, {"agent_session_id": sid}))
        return [reply for replies in await asyncio.gather(closes, seeds) for reply in replies]

    replies = await beside(bystander, attack)
    assert_refused(replies, 409, "session_conflict")
    await bystander.finish()


BAD_KEYS = {
    "15 characters": "k" * 15,
    "257 characters": "k" * 257,
    "an integer": 1234567890123456789,
}


@pytest.mark.parametrize("bad_key", list(BAD_KEYS))
@pytest.mark.parametrize("path", [SEED, CLOSE])
async def test_a_malformed_key_is_an_invalid_request(agent, web, path, bad_key):
    owner = await seeded(web, agent.url, "bad-key", new_key())
    body = {"agent_session_id": owner.session_id, "session_key": BAD_KEYS[bad_key]}

    async def attack() -> list[Reply]:
        return await many(lambda: post(web, agent.url + path, body), copies=4)

    replies = await beside(owner, attack)
    assert_refused(replies, 400, "invalid_request")
    await owner.finish()
