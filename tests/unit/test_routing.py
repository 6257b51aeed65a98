"""The routing rule with in-process workers sharing one real runtime directory."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import pytest

from gym_sessions.errors import RequestTimeoutError
from gym_sessions.routing.claim_store import FileClaimStore
from gym_sessions.routing.router import _receive_within

from .cluster import Cluster, count_call, new_id, send, wait_until
from .fake_clock import FakeClock
from .probe_server import ProbeServer

WINDOW = 1.0
STARTS = ("/seed_session", "/reset", "/blind_start")


@pytest.fixture
def cluster(start_clusters):
    """Workers whose claim windows pass only when the test says so (`Cluster.elapse`)."""

    async def make(n: int = 3, **kw) -> Cluster:
        kw.setdefault("session_close_retry_window_seconds", WINDOW)
        kw.setdefault("checkpoint_session_starts", STARTS)
        kw.setdefault("clock", FakeClock())
        return await start_clusters(ProbeServer, n, **kw)

    return make


# Session id sources ------------------------------------------------------------------------


@pytest.mark.parametrize("start_path", ["/seed_session", "/reset", "/rollouts/r7/seed_session"])
async def test_typed_start_is_claimed_by_the_worker_that_served_it(cluster, start_path):
    c = await cluster(3)
    sid = new_id()
    reply = await c[1].request("POST", start_path, {"resources_session_id": sid})
    assert reply.status == 200
    assert reply.json["resources_session_id"] == sid
    assert c.claim_owner(sid) == c[1].id
    # The typed start put its body id in the cookie.
    assert c.credentials.decode_cookie(reply.cookie)["session_id"] == sid


@pytest.mark.parametrize(
    "source",
    ["cookie", "mcp_token", "typed_seed", "typed_reset", "typed_close", "rollout_cookie"],
)
async def test_each_id_source_routes_to_the_claimant(cluster, source):
    c = await cluster(3)
    sid = new_id()
    start = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    assert start.json["worker"] == c[0].id
    token = start.json["mcp"]["headers"]["X-Gym-Session-Token"]
    for accepting in (c[1], c[2]):
        if source in ("cookie", "rollout_cookie"):
            path = "/touch" if source == "cookie" else "/rollouts/abc/touch"
            reply = await accepting.request(path=path, method="POST", cookie=start.cookie)
        elif source == "mcp_token":
            call = count_call(1)
            reply = await accepting.request(
                "POST", "/mcp", call, headers={"X-Gym-Session-Token": token}
            )
            reply.json = reply.json["result"]["structuredContent"]
        elif source == "typed_seed":
            reply = await accepting.request("POST", "/seed_session", {"resources_session_id": sid})
        elif source == "typed_reset":
            reply = await accepting.request("POST", "/reset", {"resources_session_id": sid})
        else:
            reply = await accepting.request(
                "POST", "/verify", cookie=start.cookie, headers={"x-gym-close-follows": "1"}
            )
        assert reply.status == 200, reply.json
        assert reply.json["worker"] == c[0].id
    if source == "typed_close":
        reply = await c[2].request("POST", "/close_session", {"resources_session_id": sid})
        assert reply.json == {"resources_session_id": sid, "outcome": "closed"}
        assert c[0].server.released == [sid]


async def test_state_is_never_split_across_workers(cluster):
    c = await cluster(4)
    start = await c[0].request("POST", "/seed_session", {})
    cookie = start.cookie
    counts = []
    for i in range(12):
        reply = await c[i % 4].request("POST", "/touch", cookie=cookie)
        counts.append(reply.json["count"])
        assert reply.json["worker"] == c[0].id
    assert counts == list(range(1, 13))
    assert sum(len(w.server.counts) for w in c.workers) == 1


@pytest.mark.parametrize("path", ["/touch", "/seed_session", "/verify", "/close_session"])
async def test_a_token_alone_reaches_no_route_but_mcp(cluster, path):
    c = await cluster(2)
    sid = new_id()
    start = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    token = start.json["mcp"]["headers"]["X-Gym-Session-Token"]
    for worker in c.workers:
        reply = await worker.request("POST", path, {}, headers={"X-Gym-Session-Token": token})
        assert reply.status == 403 and reply.json["error"]["code"] == "forbidden"
        assert not reply.set_cookies
    assert c[0].server.counts[sid] == 0 and c[0].server.released == []


async def test_bad_token_and_tampered_cookie_are_treated_as_absent(cluster):
    c = await cluster(2)
    sid = new_id()
    start = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    forged = start.json["mcp"]["headers"]["X-Gym-Session-Token"][:-2] + "xx"
    other_key_cookie = start.cookie[:-3] + "abc"
    for kwargs in (
        {"headers": {"X-Gym-Session-Token": forged}},
        {"cookie": other_key_cookie},
    ):
        reply = await c[1].request("POST", "/touch", **kwargs)
        assert reply.status == 200
        # A new session on the accepting worker, never the real one's state.
        assert reply.json["sid"] != sid
        assert reply.json["worker"] == c[1].id
    assert c[0].server.counts[sid] == 0


# Claims -------------------------------------------------------------------------------------


async def test_start_whose_handler_never_reads_the_session_is_claimed(cluster):
    c = await cluster(3)
    reply = await c[2].request("POST", "/blind_start")
    assert reply.status == 200 and reply.cookie
    sid = c.credentials.decode_cookie(reply.cookie)["session_id"]
    assert c.claim_owner(sid) == c[2].id
    for worker in (c[0], c[1], c[2], c[0]):
        touched = await worker.request("POST", "/touch", cookie=reply.cookie)
        assert touched.json["worker"] == c[2].id
    assert touched.json["count"] == 4


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/health", None),
        ("GET", "/nothing", None),
        ("POST", "/nothing", {"x": 1}),
        ("POST", "/aggregate_metrics", {"verify_responses": [{"reward": 1.0}]}),
        ("GET", "/no_such_route", None),
        ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}),
        ("POST", "/mcp", {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}),
        (
            "POST",
            "/mcp",
            count_call(1),
        ),
    ],
)
async def test_requests_that_keep_no_session_leave_no_claim_and_no_cookie(
    cluster, method, path, body
):
    c = await cluster(2)
    reply = await c[1].request(method, path, body)
    assert reply.set_cookies == []
    assert c.claim_count() == 0
    assert len(c[1].app.claims) == 0


async def test_tool_call_without_a_session_creates_a_claimed_session(cluster):
    c = await cluster(3)
    first = await c[1].request("POST", "/touch")
    assert first.status == 200 and first.cookie
    sid = first.json["sid"]
    assert c.claim_owner(sid) == c[1].id
    second = await c[2].request("POST", "/touch", cookie=first.cookie)
    assert second.json == {"worker": c[1].id, "sid": sid, "count": 2}


async def test_new_session_with_an_error_reply_gets_no_claim_and_no_cookie(cluster):
    c = await cluster(2)
    reply = await c[0].request("POST", "/fail_touch")
    assert reply.status == 500
    assert reply.json["error"]["code"] == "env_error"
    assert reply.set_cookies == []
    assert c.claim_count() == 0


async def test_cookie_whose_claim_ended_is_claimed_by_the_worker_that_uses_it(cluster):
    c = await cluster(3)
    sid = new_id()
    cookie = c.cookie_for(sid)  # a session nobody claims (ended, or from before a restart)
    reply = await c[2].request("POST", "/touch", cookie=cookie)
    assert reply.json == {"worker": c[2].id, "sid": sid, "count": 1}
    assert c.claim_owner(sid) == c[2].id
    # The reply names the new incarnation; the cookie of the earlier one reaches nothing.
    assert reply.cookie != cookie
    again = await c[0].request("POST", "/touch", cookie=reply.cookie)
    assert again.json["worker"] == c[2].id and again.json["count"] == 2
    stale = await c[1].request("POST", "/touch", cookie=cookie)
    assert stale.status == 409 and stale.json["error"]["code"] == "session_conflict"
    assert c[2].server.counts[sid] == 2


async def test_cookie_of_an_unclaimed_id_is_claimed_before_its_handler_runs(cluster):
    c = await cluster(2)
    sid = new_id()
    seen = []
    # The handler sees the claim already made: nobody can start the id under it.
    c[1].server.before_touch = lambda touched: seen.append(c.claim_owner(touched))
    reply = await c[1].request("POST", "/touch", cookie=c.cookie_for(sid))
    assert reply.status == 200 and seen == [c[1].id]


async def test_cookie_of_an_unclaimed_id_leaves_no_claim_when_unused(cluster):
    c = await cluster(2)
    sid = new_id()
    reply = await c[1].request("GET", "/health", cookie=c.cookie_for(sid))
    assert reply.status == 200 and reply.set_cookies == []
    assert await wait_until(lambda: c.claim_owner(sid) is None)


async def test_id_claimed_elsewhere_while_served_gets_409(cluster):
    c = await cluster(2)
    # Another worker claims the request's minted id while c[1]'s handler runs.
    rival = FileClaimStore(c.runtime_dir.claims_dir, c[0].id)
    minted = []
    c[1].server.before_touch = lambda sid: (minted.append(sid), rival.create_now(sid))
    reply = await c[1].request("POST", "/touch")
    assert reply.status == 409
    assert reply.json["error"]["code"] == "session_conflict"
    assert reply.set_cookies == []
    # The state the refused handler created is released, not left without a claim.
    sid = minted[0]
    assert sid not in c[1].server.counts
    assert c[1].server.released == [sid]


async def test_sessions_minted_on_two_workers_at_once_are_distinct(cluster):
    c = await cluster(2)
    replies = await asyncio.gather(
        *[c[i % 2].request("POST", "/seed_session", {}) for i in range(100)]
    )
    sids = {r.json["resources_session_id"] for r in replies}
    assert len(sids) == 100
    for r in replies:
        assert c.claim_owner(r.json["resources_session_id"]) == r.json["worker"]


async def test_one_worker_writes_no_claims(cluster, short_tmp):
    c = await cluster(1)
    assert c.runtime_dir is None
    assert c[0].app.forwarder is None
    start = await c[0].request("POST", "/seed_session", {})
    touched = await c[0].request("POST", "/touch", cookie=start.cookie)
    assert touched.json["count"] == 1
    assert not [p for p in os.listdir(short_tmp) if p.startswith("gym-sessions-")]


@pytest.mark.parametrize("n", [1, 3])
async def test_cookie_and_body_naming_different_sessions_get_409(cluster, n):
    c = await cluster(n)
    start = await c[0].request("POST", "/seed_session", {})
    for path in ("/seed_session", "/reset", "/close_session"):
        reply = await c[n - 1].request(
            "POST", path, {"resources_session_id": new_id()}, cookie=start.cookie
        )
        assert reply.status == 409
        assert reply.json["error"]["code"] == "session_conflict"


async def test_malformed_typed_id_gets_400(cluster):
    c = await cluster(2)
    for bad in ["../etc/passwd", "", "a" * 129, 42, "a\x00b", "with space"]:
        reply = await c[1].request("POST", "/seed_session", {"resources_session_id": bad})
        assert reply.status == 400, bad
        assert reply.json["error"]["code"] == "invalid_session_id"
    assert c.claim_count() == 0


# Forwarding -----------------------------------------------------------------------------------


async def test_forwarded_request_keeps_method_path_query_headers_and_body(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    payload = os.urandom(300_000)
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        direct = await c[0].request(
            method,
            "/rollouts/r%201/echo?a=1&b=%2F&a=2",
            raw=payload,
            cookie=start.cookie,
            headers={"X-Custom": "v1", "Content-Type": "application/octet-stream"},
        )
        routed = await c[1].request(
            method,
            "/rollouts/r%201/echo?a=1&b=%2F&a=2",
            raw=payload,
            cookie=start.cookie,
            headers={"X-Custom": "v1", "Content-Type": "application/octet-stream"},
        )
        assert routed.status == direct.status == 200
        assert routed.json["worker"] == c[0].id
        for key in ("method", "path", "query", "body_sha256", "body_size"):
            assert routed.json[key] == direct.json[key], key
        routed_headers = dict(map(tuple, routed.json["headers"]))
        assert routed_headers["x-custom"] == "v1"
        assert routed_headers["content-type"] == "application/octet-stream"
        assert routed_headers["cookie"].startswith("gym_session=")
        # Exactly the claimant's Set-Cookie (the echo wrote session data), no second one.
        assert len(routed.set_cookies) == 1


async def test_request_over_a_private_socket_is_handled_where_it_arrives(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    async with c.private_client(c[1]) as client:
        reply = await send(client, "GET", "/nothing")
        assert reply.json["worker"] == c[1].id
        # Requests for c[0]'s session, sent privately to c[1]: c[1] serves them, and
        # a cookie's id is claimed before any handler runs; c[0] holds it, so c[1]
        # refuses rather than run a handler beside the session's state.
        for path in ("/nothing", "/touch"):
            refused = await send(client, "POST", path, cookie=start.cookie)
            assert refused.status == 409 and refused.json["error"]["code"] == "session_conflict"
    assert c[0].server.counts[start.json["resources_session_id"]] == 0


async def test_typed_start_with_9_mib_of_task_data_reaches_its_claimant(cluster):
    c = await cluster(2, max_body_bytes=16 * 1024 * 1024)
    sid = new_id()
    await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    task = "x" * (9 * 1024 * 1024)
    # A restart (a second seed of the open session with another body would be 409).
    reply = await c[1].request("POST", "/reset", {"resources_session_id": sid, "task": task})
    assert reply.status == 200
    assert reply.json["worker"] == c[0].id
    assert reply.json["task_size"] == len(task)


async def test_body_over_the_limit_gets_413(cluster):
    c = await cluster(2, max_body_bytes=1000)
    reply = await c[1].request("POST", "/seed_session", raw=b"{" + b" " * 2000 + b"}")
    assert reply.status == 413
    assert reply.json["error"]["code"] == "body_too_large"
    assert c.claim_count() == 0


# Worker death -------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["socket_removed", "socket_refuses"])
async def test_session_of_an_exited_worker_gets_410(cluster, how):
    c = await cluster(3)
    sid = new_id()
    start = await c[1].request("POST", "/seed_session", {"resources_session_id": sid})
    other = await c[2].request("POST", "/seed_session", {})
    paths = [c.runtime_dir.socket_path(c[1].id)]
    await c[1].stop_listening()
    stale = []
    if how == "socket_refuses":
        # A killed worker leaves its socket files behind; connecting is refused.
        for path in paths:
            stale.append(socket.socket(socket.AF_UNIX))
            stale[-1].bind(path)
    try:
        for accepting in (c[0], c[2]):
            for method, route, kwargs in (
                ("POST", "/touch", {"cookie": start.cookie}),
                ("POST", "/verify", {"cookie": start.cookie}),
                ("POST", "/close_session", {"body": {"resources_session_id": sid}}),
                ("POST", "/seed_session", {"body": {"resources_session_id": sid}}),
            ):
                body = kwargs.pop("body", None)
                reply = await accepting.request(method, route, body, **kwargs)
                assert reply.status == 410, (route, reply.json)
                assert reply.json["error"]["code"] == "session_gone"
            # Over MCP the same refusal is a JSON-RPC error object.
            call = count_call(3)
            token = start.json["mcp"]["headers"]["X-Gym-Session-Token"]
            reply = await accepting.request(
                "POST", "/mcp", call, headers={"X-Gym-Session-Token": token}
            )
            assert reply.status == 410
            assert reply.json["error"]["data"]["code"] == "session_gone"
            assert reply.json["jsonrpc"] == "2.0"
        # Other sessions are untouched.
        ok = await c[0].request("POST", "/touch", cookie=other.cookie)
        assert ok.status == 200 and ok.json["worker"] == c[2].id
        # The claim stays until the server exits.
        assert c.claim_owner(sid) == c[1].id
    finally:
        for sock in stale:
            sock.close()


# Lifetimes (the sweep ends claims with no further request; windows pass on a fake clock) -----


async def test_open_session_keeps_its_claim_then_close_ends_it_a_window_later(cluster):
    c = await cluster(2)
    sid = new_id()
    await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    await c.elapse(WINDOW * 1.5)
    assert c.claim_owner(sid) == c[0].id  # open: never expires
    closed = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"
    assert c[0].server.released == [sid]
    await c.elapse(WINDOW * 0.75)
    assert c.claim_owner(sid) == c[0].id  # the window started at the close
    await c.elapse(WINDOW * 0.25)
    assert c.claim_owner(sid) is None
    assert sid not in c[0].app.claims


async def test_verify_ends_the_session_unless_a_close_follows(cluster):
    c = await cluster(2)
    sid = new_id()
    start = await c[0].request("POST", "/seed_session", {"resources_session_id": sid})
    await c[1].request("POST", "/verify", cookie=start.cookie, headers={"x-gym-close-follows": "1"})
    await c.elapse(WINDOW * 1.5)
    assert c.claim_owner(sid) == c[0].id
    await c[1].request("POST", "/verify", cookie=start.cookie)
    assert c[0].server.released == [sid]
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None
    again = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    # The claim has ended, so this close is new to every worker.
    assert again.json["outcome"] == "closed"


async def test_session_without_a_start_ends_a_window_after_its_last_request(cluster):
    c = await cluster(2)
    first = await c[1].request("POST", "/touch")
    sid = first.json["sid"]
    for _ in range(3):
        await c.elapse(WINDOW * 0.75)
        await c[0].request("POST", "/touch", cookie=first.cookie)
    await c.elapse(WINDOW * 0.75)
    assert c.claim_owner(sid) == c[1].id  # each request restarted its window
    assert c[1].server.released == []
    await c.elapse(WINDOW * 0.25)
    assert c.claim_owner(sid) is None
    assert c[1].server.released == [sid]


async def test_failed_start_keeps_its_claim_for_the_cleanup_close(cluster):
    c = await cluster(3)
    sid = new_id()
    failed = await c[0].request(
        "POST", "/seed_session", {"resources_session_id": sid, "fail": True}
    )
    assert failed.status == 500
    assert c.claim_owner(sid) == c[0].id
    cleanup = await c[2].request("POST", "/close_session", {"resources_session_id": sid})
    assert cleanup.json["outcome"] == "closed"
    assert c[0].server.released == [sid]  # the partial state was released on its worker
    retry = await c[1].request("POST", "/seed_session", {"resources_session_id": new_id()})
    assert retry.status == 200
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None


async def test_close_before_a_delayed_start_refuses_the_start_on_every_worker(cluster):
    c = await cluster(3)
    sid = new_id()
    closed = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    assert closed.json["outcome"] == "closed"
    assert c.claim_owner(sid) == c[1].id  # a close of an unclaimed id claims it
    for worker in c.workers:
        late = await worker.request("POST", "/seed_session", {"resources_session_id": sid})
        assert late.status == 409
        assert late.json["error"]["code"] == "session_closed"
    second = await c[0].request("POST", "/close_session", {"resources_session_id": sid})
    assert second.json["outcome"] == "already_closed"


async def test_claim_is_not_released_while_a_request_is_in_flight(cluster):
    c = await cluster(2)
    first = await c[0].request("POST", "/touch")
    sid = first.json["sid"]
    held = asyncio.create_task(c[1].request("POST", "/hold", cookie=first.cookie))
    assert await wait_until(lambda: sid in c[0].server.held)  # in its handler on c[0]
    await c.elapse(WINDOW * 1.5)
    assert c.claim_owner(sid) == c[0].id
    c[0].server.held[sid].set()
    reply = await held
    assert reply.json["worker"] == c[0].id
    await c.elapse(WINDOW * 0.75)
    assert c.claim_owner(sid) == c[0].id  # the window started when the request ended
    await c.elapse(WINDOW * 0.25)
    assert c.claim_owner(sid) is None


# Races ----------------------------------------------------------------------------------------


async def test_two_workers_starting_the_same_ids_at_once_share_one_claim(cluster):
    c = await cluster(2)
    sids = [new_id() for _ in range(60)]
    replies = await asyncio.gather(
        *[
            c[i].request("POST", "/seed_session", {"resources_session_id": sid})
            for sid in sids
            for i in (0, 1)
        ]
    )
    assert all(r.status == 200 for r in replies)
    for sid in sids:
        owner = c.claim_owner(sid)
        served_by = {r.json["worker"] for r in replies if r.json["resources_session_id"] == sid}
        assert served_by == {owner}
    assert sum(len(w.server.counts) for w in c.workers) == len(sids)


async def test_start_and_close_of_one_id_on_two_workers_at_once_stay_consistent(cluster):
    c = await cluster(2)
    sids = [new_id() for _ in range(60)]
    pairs = await asyncio.gather(
        *[
            asyncio.gather(
                c[0].request("POST", "/seed_session", {"resources_session_id": sid}),
                c[1].request("POST", "/close_session", {"resources_session_id": sid}),
            )
            for sid in sids
        ]
    )
    for start, close in pairs:
        assert close.json["outcome"] == "closed"
        assert start.status in (200, 409)
        if start.status == 409:
            assert start.json["error"]["code"] == "session_closed"
    # Whatever the order, no session is left alive anywhere.
    assert sum(len(w.server.counts) for w in c.workers) == 0


async def test_request_forwarded_after_its_claim_ended_is_served_or_refused_not_split(cluster):
    c = await cluster(3)
    first = await c[0].request("POST", "/touch")
    sid = first.json["sid"]
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None
    # The forward arrives (over c[0]'s private socket) after c[0] released the claim:
    # c[0] serves it and claims the id again.
    async with c.private_client(c[0]) as client:
        reply = await send(client, "POST", "/touch", cookie=first.cookie)
    assert reply.status == 200 and reply.json["worker"] == c[0].id
    assert c.claim_owner(sid) == c[0].id
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None
    # Now c[2] claims it first; a late forward to c[0] must not split the session.
    await c[2].request("POST", "/touch", cookie=first.cookie)
    async with c.private_client(c[0]) as client:
        late = await send(client, "POST", "/touch", cookie=first.cookie)
    assert late.status == 409


async def test_restarted_server_with_fresh_runtime_directory_serves_old_cookies(cluster):
    old = await cluster(2)
    start = await old[0].request("POST", "/seed_session", {})
    await old.stop()
    new = await cluster(2)
    assert new.runtime_dir.path != old.runtime_dir.path
    reply = await new[1].request("POST", "/touch", cookie=start.cookie)
    assert reply.status == 200 and reply.json["worker"] == new[1].id
    # A new incarnation of the id, named by the reply's cookie.
    again = await new[0].request("POST", "/touch", cookie=reply.cookie)
    assert again.json["worker"] == new[1].id and again.json["count"] == 2


def test_file_claims_have_one_winner_under_thread_races(tmp_path):
    import threading

    stores = [FileClaimStore(str(tmp_path), f"w{i}") for i in range(4)]
    sids = [new_id() for _ in range(300)]
    results: dict[int, list] = {i: [] for i in range(4)}

    def claim_all(i: int) -> None:
        for sid in sids:
            results[i].append(stores[i].create_now(sid))

    threads = [threading.Thread(target=claim_all, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, sid in enumerate(sids):
        winners = [i for i in range(4) if results[i][k] is None]
        assert len(winners) == 1
        for i in range(4):
            if i != winners[0]:
                assert results[i][k] == f"w{winners[0]}"
        assert stores[0].read_now(sid) == f"w{winners[0]}"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


async def test_debug_worker_header_names_the_worker_that_ran_the_handler(cluster):
    c = await cluster(2, debug_worker_header=True)
    start = await c[0].request("POST", "/seed_session", {})
    assert start.headers["x-gym-worker"] == c[0].id
    routed = await c[1].request("POST", "/touch", cookie=start.cookie)
    assert routed.headers.getall("x-gym-worker") == [c[0].id]
    # Handed over: the holder answered on the connection c[1] gave it; else c[1] hopped.
    moved, other = ("handed-over-by", "forwarded-by")
    if not c.settings.handoff:
        moved, other = other, moved
    assert routed.headers.getall(f"x-gym-{moved}") == [c[1].id]
    assert f"x-gym-{other}" not in routed.headers
    assert "x-gym-forwarded-by" not in start.headers
    assert "x-gym-handed-over-by" not in start.headers
    local = await c[1].request("GET", "/nothing")
    assert local.headers["x-gym-worker"] == c[1].id
    quiet = await cluster(1)
    assert "x-gym-worker" not in (await quiet[0].request("GET", "/nothing")).headers


async def test_streamed_reply_arrives_whole_through_the_hop(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    async with c.private_client(c[0]) as direct_client:
        direct = await send(direct_client, "GET", "/stream?n=40", cookie=start.cookie)
    routed = await c[1].request("GET", "/stream?n=40", cookie=start.cookie)
    assert routed.status == 200
    assert routed.json == direct.json
    assert len(routed.json) == 40 * 65536
    assert "chunked" in routed.headers.get("transfer-encoding", "")


@pytest.mark.hop_only
async def test_pooled_transport_reuses_its_connections(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    pool = c[1].app.forwarder._idle
    seen = set()
    for _ in range(30):
        reply = await c[1].request("POST", "/touch", cookie=start.cookie)
        assert reply.json["worker"] == c[0].id
        # Sequential forwards share one kept-alive connection to the claimant.
        assert len(pool[c[0].id]) == 1
        seen.add(id(pool[c[0].id][0]))
    assert len(seen) == 1


async def test_client_leaving_mid_reply_does_not_poison_the_pool(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    headers = {"Cookie": f"gym_session={start.cookie}"}
    async with c[1].client.get("http://w/stream?n=200", headers=headers) as reply:
        await reply.content.read(65536)  # then leave with most of the reply unread
    for _ in range(5):
        ok = await c[1].request("POST", "/touch", cookie=start.cookie)
        assert ok.status == 200 and ok.json["worker"] == c[0].id


def http_scope(method: str, path: str, query: bytes = b"", cookie: str | None = None) -> dict:
    """A scope as the public listener would build it."""
    headers = [(b"host", b"worker"), (b"connection", b"keep-alive")]
    if cookie:
        headers.append((b"cookie", f"gym_session={cookie}".encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": ("10.1.2.3", 40000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def test_caller_leaving_mid_reply_closes_that_connection(cluster):
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    forwarder = c[1].app.forwarder

    async def leaving_send(message: dict) -> None:
        if message["type"] == "http.response.body":
            raise OSError("the client left")

    scope = http_scope("GET", "/stream", b"n=200", start.cookie)
    with pytest.raises(OSError, match="the client left"):
        await forwarder.forward(c[0].id, scope, b"", leaving_send)
    assert not forwarder._idle.get(c[0].id)
    for _ in range(3):
        ok = await c[1].request("POST", "/touch", cookie=start.cookie)
        assert ok.status == 200 and ok.json["worker"] == c[0].id


async def test_stalled_body_gets_408_and_keeps_no_claim(cluster):
    c = await cluster(2, body_read_timeout_seconds=0.3)
    reader, writer = await asyncio.open_unix_connection(c[1].public_path)
    body = b'{"resources_session_id": "stalled"}'
    writer.write(
        b"POST /seed_session HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[:10]
    )
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(), 5)  # the server closes the connection
    writer.close()
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert b'"request_timeout"' in reply
    assert c.claim_count() == 0


async def test_oversized_headers_get_431(cluster):
    c = await cluster(2, max_header_bytes=4096)
    reply = await c[1].request("GET", "/health", headers={"X-Pad": "p" * 5000})
    assert reply.status == 431
    assert reply.json["error"]["code"] == "headers_too_large"
    assert (await c[1].request("GET", "/health", headers={"X-Pad": "p" * 3000})).status == 200


async def test_expect_100_continue_is_answered_here_and_not_forwarded(cluster):
    # Forwarded, it would make the claimant send an interim 100 that a hop could
    # take for the reply, leaving the real reply in a pooled connection.
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    headers = {"Cookie": f"gym_session={start.cookie}"}
    async with c[1].client.post(
        "http://w/echo", json={"pad": "x" * 100_000}, headers=headers, expect100=True
    ) as reply:
        data = await reply.json()
    assert reply.status == 200
    assert data["worker"] == c[0].id
    assert "expect" not in dict(map(tuple, data["headers"]))


@pytest.mark.hop_only
async def test_forwarded_head_returns_its_connection_to_the_pool(cluster):
    # The reply to HEAD has a content-length and no body: a hop that waited for
    # the body would hold the connection (and the client's) for good.
    c = await cluster(2)
    start = await c[0].request("POST", "/seed_session", {})
    headers = {"Cookie": f"gym_session={start.cookie}"}
    async with c[1].client.head("http://w/echo", headers=headers) as reply:
        assert reply.status == 200
    pool = c[1].app.forwarder._idle
    assert await wait_until(lambda: len(pool.get(c[0].id, ())) == 1, within=2)


async def test_close_without_a_session_is_refused_and_claims_nothing(cluster):
    c = await cluster(2)
    reply = await c[1].request("POST", "/close_session", {})
    assert reply.status == 400
    assert reply.json["error"]["code"] == "invalid_request"
    assert reply.set_cookies == []
    assert c.claim_count() == 0


async def test_start_that_awaits_while_its_session_closes_is_refused(cluster):
    c = await cluster(2)
    sid = new_id()
    starting = asyncio.create_task(
        c[0].request("POST", "/seed_session", {"resources_session_id": sid, "hold": True})
    )
    assert await wait_until(lambda: sid in c[0].server.held)  # the start awaits in its hook
    close = await c[1].request("POST", "/close_session", {"resources_session_id": sid})
    c[0].server.held[sid].set()
    start = await starting
    assert close.json["outcome"] == "closed"
    assert start.status == 409
    assert start.json["error"]["code"] == "session_closed"
    assert sid not in c[0].server.counts
    # Not left open: the claim ends a window after the last request.
    await c.elapse(WINDOW)
    assert c.claim_owner(sid) is None


async def test_a_receive_that_stalls_gets_408_and_other_cancellations_pass_through():
    async def ready() -> dict[str, Any]:
        return {"type": "http.request", "body": b"x"}

    async def never() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    assert await _receive_within(ready, 0.05) == {"type": "http.request", "body": b"x"}
    await asyncio.sleep(0.1)  # no timer was left to cancel this task later
    with pytest.raises(RequestTimeoutError):
        await _receive_within(never, 0.05)
    task = asyncio.ensure_future(_receive_within(never, 30))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
