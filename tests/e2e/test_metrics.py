"""``GET /metrics`` and ``gym-sessions status`` against real ``gym-sessions serve`` processes.

A known load at 4 workers (counter episodes with a new connection for every
request, so many are forwarded, plus deliberate 409s, a 410, 404s and MCP tool
calls) must come back *exactly* from ``/metrics``, whichever worker answers;
``--debug-worker-header`` tells the test which worker forwarded or served each
reply, so even the per-worker figures are known. A SIGKILLed worker must not
make a total go backwards, nor the page fail; nor must a reload (SIGHUP) that
replaces the whole generation. Random paths must not add label
values. The access rule is tried with a token and with ``--metrics off`` (a
non-loopback client is tried in process, ``tests/test_metrics.py``: the only
addresses tests may reach here are loopback ones).
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import aiohttp
import pytest

from envs.counter_load import client_session, make_episodes
from gym_sessions.metrics.status import Sample, parse_samples
from gym_sessions.secret_source import write_secret_file

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
TOKEN = "metrics-e2e-token-" + "k" * 30
# Not compared exactly: the test's own server start polls /health, and every
# scrape counts itself (checked separately).
UNCOUNTED_ROUTES = {"/health", "/metrics"}


def scrape(url: str, token: str | None = None) -> tuple[int, str]:
    """``GET /metrics`` on a new connection (urllib never reuses one)."""
    request = urllib.request.Request(url + "/metrics")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(url: str) -> list[Sample]:
    status, text = scrape(url)
    assert status == 200, text
    return parse_samples(text)


def by_labels(page: list[Sample], name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """``name``'s samples summed by the values of ``keys``."""
    summed: dict[tuple[str, ...], float] = collections.defaultdict(float)
    for sample in page:
        if sample.name == name:
            summed[tuple(sample.labels.get(key, "") for key in keys)] += sample.value
    return dict(summed)


class Load:
    """Requests on new connections, each tallied by route template and status."""

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url
        self.tally: collections.Counter[tuple[str, str]] = collections.Counter()
        self.forwarded_by: collections.Counter[str] = collections.Counter()

    async def call(
        self,
        route: str,
        path: str | None = None,
        body: Any = None,
        cookie: str | None = None,
        headers: dict[str, str] | None = None,
        method: str = "POST",
    ) -> tuple[int, Any, dict[str, str], str | None]:
        send_headers = dict(headers or {})
        if cookie:
            send_headers["Cookie"] = f"gym_session={cookie}"
        async with self.client.request(
            method, self.url + (path or route), json=body, headers=send_headers
        ) as reply:
            data = await reply.json(content_type=None) if method == "POST" else await reply.text()
            self.tally[(route, str(reply.status))] += 1
            if "x-gym-forwarded-by" in reply.headers:
                self.forwarded_by[reply.headers["x-gym-forwarded-by"]] += 1
            morsel = reply.cookies.get("gym_session")
            return reply.status, data, dict(reply.headers), morsel.value if morsel else cookie

    async def start(
        self, session_id: str, key: str, options: dict[str, Any] | None = None
    ) -> tuple[str | None, dict]:
        body = {"resources_session_id": session_id, "session_key": key, "options": options or {}}
        status, data, headers, cookie = await self.call("/reset", body=body)
        assert status == 200, data
        return cookie, {**headers, **data}


def test_four_workers_report_exactly_the_load_whichever_worker_answers(serve):
    server = serve(COUNTER, "--debug-worker-header", "--session-idle-timeout", "6", workers=4)
    episodes = make_episodes(16, seed=19)
    steps_reached = 0  # /step calls that reached the tool's handler

    async def main() -> tuple[Load, collections.Counter[str]]:
        nonlocal steps_reached
        async with client_session() as client:
            load = Load(client, server.url)
            # One session left to idle out: its step after the timeout is 410 session_expired.
            idle_id, idle_key = uuid.uuid4().hex, uuid.uuid4().hex
            idle_cookie, _ = await load.start(idle_id, idle_key)
            idled_since = time.monotonic()

            async def episode(e) -> None:
                nonlocal steps_reached
                options = {"initial_count": e.initial, "expected_count": e.expected}
                cookie, _ = await load.start(e.session_id, e.session_key, options)
                for step in e.increments:
                    status, _, _, cookie = await load.call(
                        "/step", body={"action": step}, cookie=cookie
                    )
                    assert status == 200
                    steps_reached += 1
                status, data, _, cookie = await load.call(
                    "/verify", body={}, cookie=cookie, headers={"x-gym-close-follows": "1"}
                )
                assert (status, data["reward"]) == (200, 1.0)
                names = {"resources_session_id": e.session_id, "session_key": e.session_key}
                status, _, _, _ = await load.call("/close_session", body=names, cookie=cookie)
                assert status == 200

            await asyncio.gather(*(episode(e) for e in episodes))
            # 409 session_closed: starts of closed sessions, with their own keys.
            for e in episodes[:4]:
                names = {"resources_session_id": e.session_id, "session_key": e.session_key}
                status, data, _, _ = await load.call("/reset", body=names)
                assert (status, data["error"]["code"]) == (409, "session_closed")
            # 404: steps with no session (they reach the tool), and unknown routes.
            for _ in range(3):
                status, data, _, _ = await load.call("/step", body={"action": 1})
                assert (status, data["error"]["code"]) == (404, "no_open_episode")
                steps_reached += 1
            for _ in range(3):
                status, _, _, _ = await load.call(
                    "unmatched", path=f"/no-such-{uuid.uuid4().hex}", method="GET"
                )
                assert status == 404
            # Idle 6 s, then found by the sweep (every second): expired well within 9 s.
            await asyncio.sleep(max(0.0, idled_since + 9.0 - time.monotonic()))
            status, data, _, _ = await load.call("/step", body={"action": 1}, cookie=idle_cookie)
            assert (status, data["error"]["code"]) == (410, "session_expired")
            # Three sessions left open, and two MCP tool calls on one of them.
            holders: collections.Counter[str] = collections.Counter()
            tokens = []
            for _ in range(3):
                _, reply = await load.start(uuid.uuid4().hex, uuid.uuid4().hex)
                holders[reply["x-gym-worker"]] += 1
                tokens.append(reply["mcp"]["headers"])
            for index in range(2):
                call = {
                    "jsonrpc": "2.0",
                    "id": index,
                    "method": "tools/call",
                    "params": {"name": "step", "arguments": {"action": 1}},
                }
                status, data, _, _ = await load.call("/mcp", body=call, headers=tokens[0])
                assert status == 200 and data["result"]["isError"] is False
            return load, holders

    load, holders = asyncio.run(main())
    sessions = len(episodes) + 1 + 3
    assert sum(load.forwarded_by.values()) > 0  # the hop was used
    workers_seen = set()
    for scrape_index in range(8):
        page = samples(server.url)
        requests = by_labels(page, "gym_sessions_requests_total", "route", "status")
        counted = {k: v for k, v in requests.items() if k[0] not in UNCOUNTED_ROUTES}
        assert counted == dict(load.tally), f"scrape {scrape_index}"
        # Earlier scrapes are counted once their reply is out; this one is not yet.
        assert requests.get(("/metrics", "200"), 0) == scrape_index
        served = by_labels(page, "gym_sessions_worker_requests_total", "worker", "served")
        assert sum(served.values()) == sum(requests.values())
        forwarded = {w: v for (w, s), v in served.items() if s == "forwarded" and v}
        assert forwarded == dict(load.forwarded_by)
        assert not any(v for (_, s), v in served.items() if s == "handed_over")
        refusals = by_labels(page, "gym_sessions_session_refusals_total", "status")
        assert refusals == {("409",): 4, ("410",): 1}
        assert by_labels(page, "gym_sessions_expired_sessions_total") == {(): 1}
        open_sessions = by_labels(page, "gym_sessions_open_sessions", "worker")
        assert {w: v for (w,), v in open_sessions.items() if v} == dict(holders)
        assert sum(by_labels(page, "gym_sessions_claims").values()) == sessions
        calls = by_labels(page, "gym_sessions_tool_call_seconds_count", "tool", "via")
        assert calls == {("step", "http"): steps_reached, ("step", "mcp"): 2}
        infos = by_labels(page, "gym_sessions_worker_info", "worker", "pid")
        assert len(infos) == 4 and all(w.startswith(f"{pid}-") for w, pid in infos)
        workers_seen |= {w for (w,) in open_sessions}
    assert len(workers_seen) == 4


def test_a_sigkilled_worker_leaves_totals_whole_and_the_page_answering(serve):
    server = serve(COUNTER, "--debug-worker-header", workers=4)

    async def main() -> tuple[str, str]:
        async with client_session() as client:
            load = Load(client, server.url)
            for e in make_episodes(6, seed=23):
                await load.start(e.session_id, e.session_key)
            cookie, reply = await load.start(uuid.uuid4().hex, uuid.uuid4().hex)
            return cookie, reply["x-gym-worker"]

    cookie, victim = asyncio.run(main())
    before = samples(server.url)

    def counters(page: list[Sample]) -> dict[tuple[str, tuple], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for s in page
            if s.name.endswith(("_total", "_count", "_sum", "_bucket"))
            and s.labels.get("route") not in UNCOUNTED_ROUTES
        }

    def served_excluding_scrapes(page: list[Sample]) -> float:
        requests = by_labels(page, "gym_sessions_requests_total", "route")
        return sum(v for (route,), v in requests.items() if route not in UNCOUNTED_ROUTES)

    base = counters(before)
    os.kill(int(victim.split("-", 1)[0]), signal.SIGKILL)
    deadline = time.monotonic() + 20
    replaced = False
    while time.monotonic() < deadline:
        page = samples(server.url)  # 200 every time, whichever worker answers
        now = counters(page)
        # Nothing went backwards: every counter series of before is still there, as large.
        shrunk = {k: (v, now.get(k)) for k, v in base.items() if now.get(k, -1) < v}
        assert shrunk == {}
        infos = by_labels(page, "gym_sessions_worker_info", "worker")
        # The killed worker's live gauges go; its counts stay in the totals.
        if len(infos) == 4 and (victim,) not in infos:
            replaced = True
            assert (victim,) not in by_labels(page, "gym_sessions_open_sessions", "worker")
            assert (victim, "local") in by_labels(
                page, "gym_sessions_worker_requests_total", "worker", "served"
            )
            break
        time.sleep(0.2)
    assert replaced, "no replacement worker appeared in worker_info"
    assert served_excluding_scrapes(page) == served_excluding_scrapes(before)

    async def step_lost_session() -> int:
        async with client_session() as client:
            status, _, _, _ = await Load(client, server.url).call(
                "/step", body={"action": 1}, cookie=cookie
            )
            return status

    assert asyncio.run(step_lost_session()) == 410
    refusals = by_labels(samples(server.url), "gym_sessions_session_refusals_total", "status")
    assert refusals[("410",)] == 1


def test_a_reload_keeps_the_old_generations_counts(serve):
    server = serve(COUNTER, workers=2)

    async def play_some(seed: int) -> None:
        from envs.counter_load import play

        async with client_session() as client:
            for e in make_episodes(4, seed=seed):
                assert (await play(client, server.url, e)).reward == 1.0

    asyncio.run(play_some(1))
    before = samples(server.url)
    old = set(by_labels(before, "gym_sessions_worker_info", "worker"))
    served_before = by_labels(before, "gym_sessions_worker_requests_total", "worker")
    server.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        live = set(by_labels(samples(server.url), "gym_sessions_worker_info", "worker"))
        if len(live) == 2 and not live & old:
            break
        time.sleep(0.3)
    else:
        pytest.fail(f"the new generation did not replace {old}: live {live}")
    served_gone = by_labels(samples(server.url), "gym_sessions_worker_requests_total", "worker")
    asyncio.run(play_some(2))
    after = samples(server.url)
    served_after = by_labels(after, "gym_sessions_worker_requests_total", "worker")
    for worker, count in served_before.items():
        # The drained workers' counts stay (they took scrapes until they stopped
        # accepting), unchanged once they are gone.
        assert served_gone[worker] >= count
        assert served_after[worker] == served_gone[worker]
    steps = by_labels(after, "gym_sessions_tool_call_seconds_count", "worker")
    assert sum(v for (w,), v in steps.items() if (w,) not in old) > 0  # the new ones served


def test_random_paths_add_no_label_values(serve):
    server = serve(COUNTER, workers=2)

    async def main() -> None:
        async with client_session() as client:
            for i in range(150):
                junk = uuid.uuid4().hex
                path = [f"/{junk}", f"/rollouts/{junk}/{junk}", f"/rollouts/{junk}/step"][i % 3]
                async with client.request("POST" if i % 2 else "GET", server.url + path) as reply:
                    await reply.read()

    asyncio.run(main())
    (runtime_dir,) = server.runtime_dirs()
    metrics_dir = os.path.join(runtime_dir, "metrics")
    assert os.stat(metrics_dir).st_mode & 0o777 == 0o700  # like the rest of the runtime dir
    assert os.listdir(metrics_dir)
    page = samples(server.url)
    routes = {s.labels["route"] for s in page if s.name == "gym_sessions_requests_total"}
    assert routes <= {"unmatched", "/rollouts/{rollout_id}/step", "/health", "/metrics"}
    requests = by_labels(page, "gym_sessions_requests_total", "route")
    assert requests[("unmatched",)] == 100
    assert requests[("/rollouts/{rollout_id}/step",)] == 50
    assert len([s for s in page if s.name == "gym_sessions_requests_total"]) <= 8


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gym_sessions", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_status_prints_every_live_worker_and_the_totals(serve):
    server = serve(COUNTER, workers=2)

    async def main() -> None:
        from envs.counter_load import play

        async with client_session() as client:
            await asyncio.gather(*(play(client, server.url, e) for e in make_episodes(6, seed=5)))

    asyncio.run(main())
    page = samples(server.url)
    accepted = sum(by_labels(page, "gym_sessions_worker_requests_total").values())
    result = run_cli("status", server.url)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:8] == [
        "worker", "pid", "open", "claims", "requests", "forwarded", "409", "410",
    ]  # fmt: skip
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    pids = {int(row[1]) for name, row in rows.items() if name != "total"}
    assert pids == set(server.worker_pids())
    total = rows["total"]  # no pid column
    assert int(total[2]) == 6  # claims: the six closed sessions, kept for the window
    assert int(total[3]) == accepted + 1  # what the page showed, plus that scrape
    assert total[-1] == "ms"  # steps ran: a p50 estimate

    watching = subprocess.Popen(
        [sys.executable, "-m", "gym_sessions", "status", server.url, "--watch", "0.3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(2.0)
        watching.send_signal(signal.SIGINT)
        out, err = watching.communicate(timeout=10)
    finally:
        if watching.poll() is None:
            watching.kill()
            watching.wait()
    assert watching.returncode == 0, err
    assert out.count("(Ctrl-C to stop)") >= 2
    assert out.count("\ntotal ") >= 2


def test_token_file_and_metrics_off(serve, short_tmp):
    token_file = os.path.join(short_tmp, "metrics-token")
    write_secret_file(token_file, TOKEN)
    server = serve(COUNTER, "--metrics-token-file", token_file, workers=2)
    for token in (None, "wrong-" + TOKEN):
        status, text = scrape(server.url, token)
        assert status == 401
        assert '"invalid_token"' in text
    status, text = scrape(server.url, TOKEN)
    assert status == 200
    assert len(by_labels(parse_samples(text), "gym_sessions_worker_info", "worker")) == 2
    assert run_cli("status", server.url, "--token-file", token_file).returncode == 0
    refused = run_cli("status", server.url)
    assert refused.returncode == 1
    assert "401 invalid_token" in refused.stderr

    off = serve(COUNTER, "--metrics", "off", workers=2)
    status, text = scrape(off.url)
    assert status == 404
    assert '"not_found"' in text
    assert run_cli("status", off.url).returncode == 1
