"""NeMo Gym's session contract over HTTP, at 1 and 4 workers (issue 19 item 1).

NeMo Gym 0.7.0's environment servers seed and close resources sessions under
ids they assign, cookieless and without a ``session_key``, so these servers run
with ``--trust-session-ids`` (the section "Coming from NeMo Gym" of the README
says what that costs). Each behaviour of its contract (``check_resources_session_contract``
and the agent-session tests) is one test here. Every request goes on a new
connection, so at 4 workers requests land on any worker and are routed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from gym_sessions.server.process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
AGENT = "envs.counter_agent:CounterAgent"
COOKIE = "gym_session"
TOKEN = "X-Gym-Session-Token"
#: Copies of a repeated request, each on a new connection (so at 4 workers
#: some land on the worker holding the session and some are forwarded).
COPIES = 6


def _serve(target: str, workers: int, *args: str) -> Iterator[ServerProcess]:
    tmp = tempfile.mkdtemp(prefix="gs-nemo-", dir="/tmp")
    server = start_server(target, *args, workers=workers, tmpdir=os.path.join(tmp, "s"))
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=[1, 4], ids=["1-worker", "4-workers"])
def resources(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The counter env served as NeMo needs it: ids trusted, a long window."""
    yield from _serve(COUNTER, request.param, "--trust-session-ids", "--window", "300")


@pytest.fixture(scope="module", params=[1, 4], ids=["1-worker", "4-workers"])
def agent(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    yield from _serve(AGENT, request.param, "--trust-session-ids", "--window", "300")


@pytest.fixture(scope="module")
def untrusting() -> Iterator[ServerProcess]:
    """The counter at 4 workers without ``--trust-session-ids``: ownership as usual."""
    yield from _serve(COUNTER, 4, "--window", "300")


@dataclass
class Reply:
    status: int
    json: Any
    cookie: str | None

    @property
    def code(self) -> Any:
        error = self.json.get("error") if isinstance(self.json, dict) else None
        return error.get("code") if isinstance(error, dict) else None


async def post(
    web: aiohttp.ClientSession, url: str, body: Any, *, cookie: str | None = None
) -> Reply:
    headers = {"Cookie": f"{COOKIE}={cookie}"} if cookie else {}
    async with web.post(url, json=body, headers=headers) as reply:
        text = await reply.text()
        cookie_value = None
        for header in reply.headers.getall("Set-Cookie", []):
            name, _, value = header.split(";", 1)[0].partition("=")
            if name.strip() == COOKIE and value.strip():
                cookie_value = value.strip()
        try:
            data = json.loads(text)
        except ValueError:
            data = text
        return Reply(reply.status, data, cookie_value)


def episode(rollout: str = "rollout", attempt: int = 0) -> dict[str, Any]:
    return {"rollout_id": rollout, "attempt": attempt}


def typed_seed(sid: str, **changes: Any) -> dict[str, Any]:
    """NeMo's ``ResourcesSeedSessionRequest``: id, episode, task and its data."""
    return {
        "resources_session_id": sid,
        "episode_id": episode(),
        "task_id": {"taskset": "counter", "task_id": "0"},
        "task_data": {"goal": 7},
        **changes,
    }


def typed_close(sid: str, **changes: Any) -> dict[str, Any]:
    """NeMo's ``ResourcesCloseSessionRequest``."""
    return {"resources_session_id": sid, "episode_id": episode(), **changes}


def new_id(label: str) -> str:
    return f"nemo-{label}-{uuid.uuid4().hex}"


async def copies(make: Any, n: int = COPIES) -> list[Reply]:
    return list(await asyncio.gather(*(make() for _ in range(n))))


# ----------------------------------------------------------------------------- resources seeds


async def test_typed_seed_opens_the_session_under_the_callers_id(resources, web):
    sid = new_id("seed")
    seeded = await post(web, resources.url + "/seed_session", typed_seed(sid))
    assert seeded.status == 200, seeded.json
    # NeMo's reply model forbids other fields: just the id and the MCP access.
    assert set(seeded.json) == {"resources_session_id", "resources_tools"}
    assert seeded.json["resources_session_id"] == sid
    tools = seeded.json["resources_tools"]
    assert set(tools) == {"server_name", "url_path", "transport", "headers"}
    assert (tools["url_path"], tools["transport"]) == ("/mcp", "http")
    assert tools["headers"][TOKEN]
    # NeMo's environment server refuses a seed that set no cookie.
    assert seeded.cookie
    observed = await post(web, resources.url + "/observe", {}, cookie=seeded.cookie)
    assert observed.json == {"observation": 0, "episode_length": 0}


async def test_repeated_seed_returns_the_existing_session(resources, web):
    sid = new_id("repeat")
    first = await post(web, resources.url + "/seed_session", typed_seed(sid))
    assert first.status == 200, first.json
    step = await post(web, resources.url + "/step", {"action": 5}, cookie=first.cookie)
    assert step.json["observation"] == 5
    # Cookieless retries (a lost reply), on any worker: the same reply, the episode kept.
    for again in await copies(lambda: post(web, resources.url + "/seed_session", typed_seed(sid))):
        assert (again.status, again.json) == (200, first.json)
    # As NeMo's test client would send it: with the cookie the first seed set.
    again = await post(web, resources.url + "/seed_session", typed_seed(sid), cookie=first.cookie)
    assert (again.status, again.json) == (200, first.json)
    observed = await post(web, resources.url + "/observe", {}, cookie=first.cookie)
    assert observed.json == {"observation": 5, "episode_length": 1}


async def test_simultaneous_seeds_open_one_session(resources, web):
    sid = new_id("simultaneous")
    replies = await copies(lambda: post(web, resources.url + "/seed_session", typed_seed(sid)))
    assert {reply.status for reply in replies} == {200}
    assert all(reply.json == replies[0].json for reply in replies)


async def test_seed_for_another_episode_is_refused(resources, web):
    sid = new_id("other-episode")
    first = await post(web, resources.url + "/seed_session", typed_seed(sid))
    await post(web, resources.url + "/step", {"action": 2}, cookie=first.cookie)
    other = typed_seed(sid, episode_id=episode("other"))
    for refused in await copies(lambda: post(web, resources.url + "/seed_session", other)):
        assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
        assert refused.cookie is None
    observed = await post(web, resources.url + "/observe", {}, cookie=first.cookie)
    assert observed.json == {"observation": 2, "episode_length": 1}


async def test_seed_with_other_task_data_is_refused(resources, web):
    sid = new_id("other-task")
    first = await post(web, resources.url + "/seed_session", typed_seed(sid))
    other = typed_seed(sid, task_data={"goal": 8})
    refused = await post(web, resources.url + "/seed_session", other)
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    again = await post(web, resources.url + "/seed_session", typed_seed(sid))
    assert (again.status, again.json) == (200, first.json)


async def test_reset_still_starts_a_new_episode(resources, web):
    sid = new_id("reset")
    first = await post(web, resources.url + "/seed_session", typed_seed(sid))
    await post(web, resources.url + "/step", {"action": 3}, cookie=first.cookie)
    reset = await post(
        web,
        resources.url + "/reset",
        {"resources_session_id": sid, "options": {"initial_count": 10}},
        cookie=first.cookie,
    )
    assert (reset.status, reset.json["observation"]) == (200, 10), reset.json
    observed = await post(web, resources.url + "/observe", {}, cookie=first.cookie)
    assert observed.json == {"observation": 10, "episode_length": 0}


async def test_malformed_episode_id_is_an_invalid_request(resources, web):
    for bad in ({"attempt": 0}, {"rollout_id": "", "attempt": 0}, {"rollout_id": "r", "x": 1}):
        for path, body in (
            ("/seed_session", typed_seed(new_id("bad"), episode_id=bad)),
            ("/close_session", typed_close(new_id("bad"), episode_id=bad)),
        ):
            reply = await post(web, resources.url + path, body)
            assert (reply.status, reply.code) == (400, "invalid_request"), (path, reply.json)


async def test_the_contract_in_order_with_a_cookie_jar(resources):
    """NeMo's helper drives one client that keeps cookies: seed twice, close twice,
    close a never-seeded id, then both late seeds are refused."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.CookieJar(unsafe=True),  # keeps cookies for 127.0.0.1
        timeout=aiohttp.ClientTimeout(total=60),
    ) as client:
        sid = new_id("in-order")
        never = f"{sid}-never-seeded"

        async def send(path: str, body: dict[str, Any]) -> Reply:
            async with client.post(resources.url + path, json=body) as reply:
                return Reply(reply.status, await reply.json(content_type=None), None)

        for _ in ("seed", "repeated seed"):
            seeded = await send("/seed_session", typed_seed(sid))
            assert seeded.status == 200, seeded.json
            assert seeded.json["resources_session_id"] == sid
        for _ in ("close", "repeated close"):
            closed = await send("/close_session", typed_close(sid))
            assert (closed.status, closed.json) == (200, {"resources_session_id": sid})
        # Here the helper's one jar differs on purpose: it still holds the closed
        # session's cookie, and a cookie and a body naming different sessions is 409
        # (NeMo's environment servers send each close with its own session's cookies).
        mixed = await send("/close_session", typed_close(never))
        assert (mixed.status, mixed.code) == (409, "session_conflict"), mixed.json
        client.cookie_jar.clear()
        closed = await send("/close_session", typed_close(never))
        assert (closed.status, closed.json) == (200, {"resources_session_id": never})
        for late in (sid, never):
            refused = await send("/seed_session", typed_seed(late))
            assert refused.status >= 400, (late, refused.json)


# ----------------------------------------------------------------------------- resources closes


async def test_close_takes_typed_fields_and_repeats(resources, web):
    sid = new_id("close")
    seeded = await post(web, resources.url + "/seed_session", typed_seed(sid))
    closes = [await post(web, resources.url + "/close_session", typed_close(sid))]
    closes += await copies(lambda: post(web, resources.url + "/close_session", typed_close(sid)))
    for closed in closes:
        assert (closed.status, closed.json) == (200, {"resources_session_id": sid})
    gone = await post(web, resources.url + "/observe", {}, cookie=seeded.cookie)
    assert (gone.status, gone.code) == (409, "session_closed"), gone.json


async def test_close_of_another_episode_is_refused(resources, web):
    sid = new_id("close-other")
    seeded = await post(web, resources.url + "/seed_session", typed_seed(sid))
    other = typed_close(sid, episode_id=episode("rollout", attempt=1))
    refused = await post(web, resources.url + "/close_session", other)
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    observed = await post(web, resources.url + "/observe", {}, cookie=seeded.cookie)
    assert observed.status == 200, observed.json  # still open
    closed = await post(web, resources.url + "/close_session", typed_close(sid))
    assert closed.status == 200, closed.json
    # Once closed, a close naming another episode is still refused.
    refused = await post(web, resources.url + "/close_session", other)
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json


async def test_close_of_a_never_seeded_session_succeeds(resources, web):
    sid = new_id("never-seeded")
    closed = await post(web, resources.url + "/close_session", typed_close(sid))
    assert (closed.status, closed.json) == (200, {"resources_session_id": sid})


async def test_seed_after_close_is_refused(resources, web):
    seeded_sid, never_sid = new_id("late-seed"), new_id("late-never")
    await post(web, resources.url + "/seed_session", typed_seed(seeded_sid))
    for sid in (seeded_sid, never_sid):
        closed = await post(web, resources.url + "/close_session", typed_close(sid))
        assert closed.status == 200, closed.json
    for sid in (seeded_sid, never_sid):
        for late in await copies(
            lambda s=sid: post(web, resources.url + "/seed_session", typed_seed(s))
        ):
            assert (late.status, late.code) == (409, "session_closed"), late.json


async def test_native_requests_keep_their_replies(resources, web):
    """Without ``episode_id`` a start and a close answer as gym-sessions always did."""
    sid = new_id("native")
    body = {"resources_session_id": sid, "options": {"initial_count": 4}}
    seeded = await post(web, resources.url + "/seed_session", body)
    assert seeded.status == 200, seeded.json
    assert {"resources_session_id", "observation", "info", "mcp"} <= set(seeded.json)
    again = await post(web, resources.url + "/seed_session", body)
    assert (again.status, again.json) == (200, seeded.json)
    closed = await post(web, resources.url + "/close_session", {"resources_session_id": sid})
    assert closed.json == {"resources_session_id": sid, "outcome": "closed"}


# ----------------------------------------------------------------------------- ownership kept


async def test_without_trust_the_id_alone_does_not_reach_the_session(untrusting, web):
    """What ``--trust-session-ids`` gives up: here a retry needs the cookie or the key."""
    url, sid, key = untrusting.url, new_id("untrusted"), "key-" + uuid.uuid4().hex
    first = await post(web, url + "/seed_session", typed_seed(sid, session_key=key))
    assert first.status == 200, first.json
    for refused in await copies(lambda: post(web, url + "/seed_session", typed_seed(sid))):
        assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    by_key = await post(web, url + "/seed_session", typed_seed(sid, session_key=key))
    assert (by_key.status, by_key.json) == (200, first.json)
    by_cookie = await post(web, url + "/seed_session", typed_seed(sid), cookie=first.cookie)
    assert (by_cookie.status, by_cookie.json) == (200, first.json)
    refused = await post(web, url + "/close_session", typed_close(sid))
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    closed = await post(web, url + "/close_session", typed_close(sid, session_key=key))
    assert (closed.status, closed.json) == (200, {"resources_session_id": sid})


# ----------------------------------------------------------------------------- agent sessions


def agent_seed(sid: str, **changes: Any) -> dict[str, Any]:
    """NeMo's ``AgentSeedSessionRequest`` (the counter agent's own ``values`` beside it)."""
    return {
        "agent_session_id": sid,
        "episode_id": episode(),
        "task_id": {"taskset": "counter", "task_id": "0"},
        "tool_accesses": [{"kind": "direct_http", "name": "counter", "required": True}],
        "values": [1, 2],
        **changes,
    }


def agent_close(sid: str, **changes: Any) -> dict[str, Any]:
    return {"agent_session_id": sid, "episode_id": episode(), **changes}


async def test_agent_seed_retries_initialize_once(agent, web):
    sid = new_id("agent-seed")
    replies = await copies(lambda: post(web, agent.url + "/v1/agent_sessions", agent_seed(sid)))
    for reply in replies:
        assert (reply.status, reply.json) == (200, {"agent_session_id": sid}), reply.json
    cookie = next(reply.cookie for reply in replies if reply.cookie)
    remembered = await post(web, agent.url + "/remember", {"value": 4}, cookie=cookie)
    # Seeded once: one retry more would have started the values afresh.
    assert remembered.json == {"count": 3, "total": 7}, remembered.json


async def test_agent_seed_with_another_body_is_refused(agent, web):
    sid = new_id("agent-other")
    first = await post(web, agent.url + "/v1/agent_sessions", agent_seed(sid))
    assert first.status == 200, first.json
    changed = agent_seed(sid, tool_accesses=[{"kind": "direct_http", "name": "different"}])
    for body in (changed, agent_seed(sid, episode_id=episode("other"))):
        refused = await post(web, agent.url + "/v1/agent_sessions", body)
        assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    # A native seed (no episode_id) with another body is refused the same way.
    native = {"agent_session_id": new_id("agent-native"), "values": [1]}
    seeded = await post(web, agent.url + "/v1/agent_sessions", native)
    assert seeded.json == {"agent_session_id": native["agent_session_id"], "created": True}
    again = await post(web, agent.url + "/v1/agent_sessions", native)
    assert again.json == {"agent_session_id": native["agent_session_id"], "created": False}
    refused = await post(web, agent.url + "/v1/agent_sessions", {**native, "values": [2]})
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json


async def test_agent_close_retries_get_the_same_receipt(agent, web):
    sid = new_id("agent-close")
    await post(web, agent.url + "/v1/agent_sessions", agent_seed(sid))
    first = await post(web, agent.url + "/v1/agent_sessions/close", agent_close(sid))
    # NeMo's shape: the id and the agent's own fields, no outcome.
    assert (first.status, first.json) == (200, {"agent_session_id": sid, "count": 2, "total": 3})
    for again in await copies(
        lambda: post(web, agent.url + "/v1/agent_sessions/close", agent_close(sid))
    ):
        assert (again.status, again.json) == (200, first.json)
    wrong = agent_close(sid, episode_id=episode("other"))
    refused = await post(web, agent.url + "/v1/agent_sessions/close", wrong)
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json


async def test_agent_close_of_an_unknown_id_blocks_a_late_seed(agent, web):
    sid = new_id("agent-unknown")
    closed = await post(web, agent.url + "/v1/agent_sessions/close", agent_close(sid))
    assert (closed.status, closed.json) == (200, {"agent_session_id": sid})
    late = await post(web, agent.url + "/v1/agent_sessions", agent_seed(sid))
    assert (late.status, late.code) == (409, "session_closed"), late.json


# ----------------------------------------------------------------------------- failed closes


@pytest.fixture(scope="module", params=[1, 4], ids=["1-worker", "4-workers"])
def flaky(request: pytest.FixtureRequest) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """An env and an agent whose releases fail the first ``fail_closes`` times."""
    args = ("--trust-session-ids", "--window", "300")
    for env in _serve("tests.e2e.flaky_close:FlakyCloseEnv", request.param, *args):
        for agent_server in _serve("tests.e2e.flaky_close:FlakyCloseAgent", request.param, *args):
            yield env, agent_server


async def test_a_failed_close_raises_and_its_retry_releases(flaky, web):
    url = flaky[0].url
    sid = new_id("flaky")
    await post(web, url + "/seed_session", typed_seed(sid, options={"fail_closes": 2}))
    for _ in range(2):
        failed = await post(web, url + "/close_session", typed_close(sid))
        assert (failed.status, failed.code) == (500, "env_error"), failed.json
        # Closed all the same: a late seed is refused while the release is retried.
        late = await post(web, url + "/seed_session", typed_seed(sid))
        assert (late.status, late.code) == (409, "session_closed"), late.json
    for _ in range(2):
        closed = await post(web, url + "/close_session", typed_close(sid))
        assert (closed.status, closed.json) == (200, {"resources_session_id": sid})
    # Natively the outcome says what each close did.
    native = new_id("flaky-native")
    await post(web, url + "/reset", {"resources_session_id": native, "options": {"fail_closes": 1}})
    outcomes = [
        (await post(web, url + "/close_session", {"resources_session_id": native})).json["outcome"]
        for _ in range(3)
    ]
    assert outcomes == ["release_failed", "closed", "already_closed"]


async def test_a_failed_agent_close_keeps_its_state_for_the_retry(flaky, web):
    url = flaky[1].url
    sid = new_id("flaky-agent")
    await post(web, url + "/v1/agent_sessions", agent_seed(sid, fail_closes=1))
    failed = await post(web, url + "/v1/agent_sessions/close", agent_close(sid))
    assert (failed.status, failed.code) == (500, "env_error"), failed.json
    refused = await post(web, url + "/v1/agent_sessions", agent_seed(sid, fail_closes=1))
    assert (refused.status, refused.code) == (409, "session_conflict"), refused.json
    closed = await post(web, url + "/v1/agent_sessions/close", agent_close(sid))
    assert (closed.status, closed.json) == (200, {"agent_session_id": sid, "attempts": 2})
    again = await post(web, url + "/v1/agent_sessions/close", agent_close(sid))
    assert (again.status, again.json) == (200, closed.json)
    late = await post(web, url + "/v1/agent_sessions", agent_seed(sid, fail_closes=1))
    assert (late.status, late.code) == (409, "session_closed"), late.json
