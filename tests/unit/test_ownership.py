"""The ownership rule (`SessionAccess`) with in-process workers on real sockets.

Every attacker request goes to a worker other than the session's claimant, so
the rule is checked where it must hold: on the claimant, after a forward. Each
refusal is checked for what it must not do too: change state, set a cookie,
mint a token. The same rule runs with claims in Redis (several hosts).
"""

from __future__ import annotations

import asyncio

import pytest

from gym_sessions.credentials import INCARNATION_KEY

from .cluster import CLOSE_RETRY_WINDOW, Cluster, count_call, honest_key, new_id, wait_until
from .probe_agent import ProbeAgent
from .probe_server import ProbeServer

WINDOW = CLOSE_RETRY_WINDOW  # the shared cluster fixture's close-retry window
TOKEN = "X-Gym-Session-Token"
ATTACKER_KEY = "attacker-key-" + "a" * 20


async def _start(c: Cluster, worker: int = 0, **body):
    sid = body.pop("sid", None) or new_id()
    reply = await c[worker].request("POST", "/seed_session", {"resources_session_id": sid, **body})
    assert reply.status == 200, reply.json
    return sid, reply


def _refused(reply, code: str = "session_conflict", status: int = 409) -> None:
    assert reply.status == status, reply.json
    assert reply.json["error"]["code"] == code
    assert reply.set_cookies == []
    assert "mcp" not in reply.json


# Starts and closes naming someone else's session ------------------------------------------


@pytest.mark.parametrize("path", ["/seed_session", "/reset", "/rollouts/r1/reset"])
@pytest.mark.parametrize("proof", ["none", "wrong_key", "no_key_bound"])
async def test_a_start_naming_a_held_session_needs_its_cookie_or_key(cluster, path, proof):
    c = await cluster()
    if proof == "no_key_bound":
        sid, start = await _start(c, session_key=None)  # reachable by its cookie only
        body = {"resources_session_id": sid, "session_key": ATTACKER_KEY}
    else:
        sid, start = await _start(c)
        key = None if proof == "none" else ATTACKER_KEY
        body = {"resources_session_id": sid, "session_key": key}
    await c[0].request("POST", "/touch", cookie=start.cookie)
    for attacker in (c[1], c[2], c[0]):
        _refused(await attacker.request("POST", path, body))
    # The victim's session carries on where it was.
    touched = await c[2].request("POST", "/touch", cookie=start.cookie)
    assert touched.json["count"] == 2 and touched.json["worker"] == c[0].id


@pytest.mark.parametrize("proof", ["none", "wrong_key"])
async def test_a_close_naming_a_held_session_needs_its_cookie_or_key(cluster, proof):
    c = await cluster()
    sid, start = await _start(c)
    key = None if proof == "none" else ATTACKER_KEY
    reply = await c[1].request(
        "POST", "/close_session", {"resources_session_id": sid, "session_key": key}
    )
    _refused(reply)
    assert c[0].server.released == []
    assert (await c[2].request("POST", "/touch", cookie=start.cookie)).json["count"] == 1


async def test_the_owner_reaches_its_session_by_key_without_a_cookie(cluster):
    c = await cluster()
    sid, start = await _start(c)
    await c[0].request("POST", "/touch", cookie=start.cookie)
    # A start whose reply was lost, retried without the cookie: same session, new episode.
    retried = await c[1].request("POST", "/reset", {"resources_session_id": sid})
    assert retried.status == 200 and retried.json["worker"] == c[0].id
    assert retried.set_cookies and TOKEN in retried.json["mcp"]["headers"]
    # Its cookie names the same incarnation as the first one.
    first = c.credentials.decode_cookie(start.cookie)
    again = c.credentials.decode_cookie(retried.cookie)
    assert again == first and first[INCARNATION_KEY]
    closed = await c[2].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json == {"resources_session_id": sid, "outcome": "closed"}
    assert c[0].server.released == [sid]


async def test_a_cookie_reaches_its_session_even_with_a_wrong_key(cluster):
    c = await cluster()
    sid, start = await _start(c)
    reply = await c[1].request(
        "POST",
        "/reset",
        {"resources_session_id": sid, "session_key": ATTACKER_KEY},
        cookie=start.cookie,
    )
    assert reply.status == 200
    # The wrong key was not bound: the honest key still works, the other not.
    _refused(
        await c[2].request(
            "POST", "/close_session", {"resources_session_id": sid, "session_key": ATTACKER_KEY}
        )
    )
    closed = await c[2].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"


async def test_a_closed_id_is_refused_without_proof_and_closed_with_it(cluster):
    c = await cluster()
    sid, _ = await _start(c)
    await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    _refused(
        await c[2].request("POST", "/reset", {"resources_session_id": sid, "session_key": None})
    )
    # With its key: the close is remembered, so the start is refused as closed.
    _refused(await c[2].request("POST", "/reset", {"resources_session_id": sid}), "session_closed")
    again = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert again.json["outcome"] == "already_closed"


async def test_a_close_before_the_start_binds_the_key_of_the_start_to_come(cluster):
    c = await cluster()
    sid = new_id()
    early = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert early.json["outcome"] == "closed"
    _refused(
        await c[2].request("POST", "/seed_session", {"resources_session_id": sid}),
        "session_closed",
    )
    _refused(
        await c[0].request(
            "POST", "/seed_session", {"resources_session_id": sid, "session_key": ATTACKER_KEY}
        )
    )


@pytest.mark.parametrize("key", [123, "short", "k" * 257, ["x" * 20]])
async def test_malformed_session_keys_are_400_and_claim_nothing(cluster, key):
    c = await cluster()
    sid = new_id()
    reply = await c[1].request(
        "POST", "/seed_session", {"resources_session_id": sid, "session_key": key}
    )
    assert reply.status == 400 and reply.json["error"]["code"] == "invalid_request"
    assert c.claim_owner(sid) is None


async def test_two_starts_of_a_new_id_with_different_keys_at_once_one_wins(cluster):
    c = await cluster()
    for _ in range(20):
        sid = new_id()
        keys = [f"racer-{i}-" + "r" * 20 for i in range(3)]
        replies = await asyncio.gather(
            *[
                c[i].request(
                    "POST", "/seed_session", {"resources_session_id": sid, "session_key": k}
                )
                for i, k in enumerate(keys)
            ]
        )
        winners = [i for i, r in enumerate(replies) if r.status == 200]
        assert len(winners) == 1, [r.json for r in replies]
        for i, reply in enumerate(replies):
            if i not in winners:
                _refused(reply)
        # The winner's key is the bound one.
        won = keys[winners[0]]
        closed = await c[(winners[0] + 1) % 3].request(
            "POST", "/close_session", {"resources_session_id": sid, "session_key": won}
        )
        assert closed.json["outcome"] == "closed"


async def test_trusted_session_ids_reach_sessions_by_id_alone(cluster):
    c = await cluster(trust_session_ids=True)
    sid, _ = await _start(c, session_key=None)
    retried = await c[1].request(
        "POST", "/reset", {"resources_session_id": sid, "session_key": None}
    )
    assert retried.status == 200 and retried.json["worker"] == c[0].id
    closed = await c[2].request(
        "POST", "/close_session", {"resources_session_id": sid, "session_key": None}
    )
    assert closed.json["outcome"] == "closed"


# Incarnations: a reused id after its window ------------------------------------------------


async def test_credentials_of_an_earlier_incarnation_reach_nothing(cluster):
    c = await cluster()
    sid, old = await _start(c, worker=0)
    old_token = old.json["mcp"]["headers"][TOKEN]
    await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert await wait_until(lambda: c.claim_owner(sid) is None, within=10)
    # Someone else starts the id anew, with its own key.
    new_key = "new-owner-key-" + "n" * 20
    reply = await c[1].request(
        "POST", "/seed_session", {"resources_session_id": sid, "session_key": new_key}
    )
    assert reply.status == 200 and reply.json["worker"] == c[1].id
    await c[1].request("POST", "/touch", cookie=reply.cookie)
    for accepting in (c[0], c[2]):
        _refused(await accepting.request("POST", "/touch", cookie=old.cookie))
        mcp = await accepting.request("POST", "/mcp", count_call(1), headers={TOKEN: old_token})
        assert mcp.status == 401 and mcp.json["error"]["data"]["code"] == "invalid_token"
        assert mcp.set_cookies == []
        _refused(await accepting.request("POST", "/close_session", {"resources_session_id": sid}))
    assert c[1].server.counts[sid] == 1
    assert (await c[2].request("POST", "/touch", cookie=reply.cookie)).json["count"] == 2


async def test_a_token_of_an_ended_session_nobody_holds_claims_nothing(cluster):
    c = await cluster()
    sid, start = await _start(c)
    token = start.json["mcp"]["headers"][TOKEN]
    await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert await wait_until(lambda: c.claim_owner(sid) is None, within=10)
    for worker in c.workers:
        reply = await worker.request("POST", "/mcp", count_call(2), headers={TOKEN: token})
        assert reply.status == 401 and reply.set_cookies == []
    assert c.claim_owner(sid) is None


# The MCP token ------------------------------------------------------------------------------


async def test_the_token_reaches_mcp_tool_calls_of_its_session_only(cluster):
    c = await cluster()
    sid, start = await _start(c)
    token = start.json["mcp"]["headers"][TOKEN]
    call = await c[1].request("POST", "/mcp", count_call(1), headers={TOKEN: token})
    assert call.json["result"]["structuredContent"]["sid"] == sid
    assert call.set_cookies == []
    for path, body in (
        ("/seed_session", {}),
        ("/reset", {"resources_session_id": sid}),
        ("/verify", {}),
        ("/close_session", {}),
        ("/touch", None),
    ):
        reply = await c[2].request("POST", path, body, headers={TOKEN: token})
        _refused(reply, "forbidden", 403)
    assert c[0].server.counts[sid] == 0 and c[0].server.released == []


async def test_a_start_may_limit_the_tools_of_its_token(cluster):
    c = await cluster(server=ProbeServer)
    sid, start = await _start(c, mcp_tools=[])
    token = start.json["mcp"]["headers"][TOKEN]
    listed = await c[1].request(
        "POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers={TOKEN: token}
    )
    assert listed.json["result"]["tools"] == []
    called = await c[2].request("POST", "/mcp", count_call(2), headers={TOKEN: token})
    assert called.json["error"]["message"] == "unknown tool: 'count'"
    # A token of a restart that names the tool lists and calls it.
    allowed = await c[1].request(
        "POST", "/reset", {"resources_session_id": sid, "mcp_tools": ["count"]}
    )
    wide = allowed.json["mcp"]["headers"][TOKEN]
    listed = await c[2].request(
        "POST", "/mcp", {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, headers={TOKEN: wide}
    )
    assert [t["name"] for t in listed.json["result"]["tools"]] == ["count"]
    unknown = await c[0].request(
        "POST", "/seed_session", {"resources_session_id": new_id(), "mcp_tools": ["rm -rf"]}
    )
    assert unknown.status == 400 and unknown.json["error"]["code"] == "invalid_request"


# Agent sessions -----------------------------------------------------------------------------


async def test_agent_seeds_and_closes_need_the_cookie_or_the_key(cluster):
    c = await cluster(server=ProbeAgent)
    sid = new_id()
    seeded = await c[0].request("POST", "/v1/agent_sessions", {"agent_session_id": sid})
    assert seeded.status == 200 and seeded.json["created"] is True
    for key in (None, ATTACKER_KEY):
        for attacker in (c[1], c[2]):
            for path in ("/v1/agent_sessions", "/v1/agent_sessions/close"):
                body = {"agent_session_id": sid, "session_key": key}
                _refused(await attacker.request("POST", path, body))
    bumped = await c[1].request("POST", "/bump", cookie=seeded.cookie)
    assert bumped.json["n"] == 1
    closed = await c[2].request(
        "POST",
        "/v1/agent_sessions/close",
        {"agent_session_id": sid, "session_key": honest_key(sid)},
    )
    assert closed.json["outcome"] == "closed" and closed.json["n"] == 1
