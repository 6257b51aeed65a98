"""Session routing with real ``gym-sessions serve --workers 4`` processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request

import pytest

from envs.counter_load import client_session, make_episodes, play, play_all
from tests.services import claim_owner

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
EPISODES = 200
WINDOW = "2"

# The routing rule with connection handoff on, over a pool of kept-alive
# connections that each carry many sessions (so connections really move), and
# off, with a new connection per request (every routed request hopped).
DELIVERY = pytest.mark.parametrize(
    "handoff", [True, False], ids=["handoff_kept_alive", "hop_fresh_connections"]
)


def serve_routed(serve, handoff: bool):
    return serve(COUNTER, "--window", WINDOW, "--handoff", "on" if handoff else "off", workers=4)


def deliveries(url: str, workers: int = 4, among: str | None = None) -> dict[str, dict]:
    """Each worker's ``/health`` deliveries: new connections until ``workers`` answered
    (and ``among`` is one of them)."""
    seen: dict[str, dict] = {}
    for _ in range(400):
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            health = json.load(reply)
        seen[health["worker"]] = health["deliveries"]
        if len(seen) >= workers and (among is None or among in seen):
            break
    return seen


@DELIVERY
def test_four_routed_workers_score_every_episode_and_leave_no_claims(serve, handoff):
    server = serve_routed(serve, handoff)
    episodes = asyncio.run(
        play_all(server.url, make_episodes(EPISODES, seed=1), fresh_connections=not handoff)
    )
    rewards = [e.reward for e in episodes]
    assert rewards.count(1.0) == EPISODES, [e.error_codes for e in episodes if e.reward != 1.0][:5]
    assert all(status == 200 for e in episodes for status in e.statuses)
    # Sessions were spread over workers, and the hop was really used.
    assert server.claim_files()  # closed sessions keep their claim for the window
    deadline = time.monotonic() + float(WINDOW) + 5
    while server.claim_files() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.claim_files() == []
    handed = sum(d["handed_over"] for d in deliveries(server.url).values())
    assert handed > 0 if handoff else handed == 0


@DELIVERY
def test_untyped_starts_route_by_the_minted_cookie(serve, handoff):
    server = serve_routed(serve, handoff)
    episodes = asyncio.run(
        play_all(server.url, make_episodes(100, seed=2), typed=False, fresh_connections=not handoff)
    )
    assert [e.reward for e in episodes].count(1.0) == 100


def test_without_routing_four_workers_lose_state(serve):
    """The failure routing prevents; the figure goes in the README."""
    server = serve(COUNTER, "--no-routing", workers=4)
    # Its runtime directory holds the metrics files only: no claims, no private sockets.
    assert server.worker_sockets() == []
    episodes = asyncio.run(play_all(server.url, make_episodes(EPISODES, seed=1)))
    correct = [e.reward for e in episodes].count(1.0)
    print(f"\n--no-routing, 4 workers: {correct} of {EPISODES} episodes scored 1.0")
    assert correct < EPISODES * 0.8


def test_one_worker_scores_every_episode(serve):
    server = serve(COUNTER, workers=1)
    episodes = asyncio.run(play_all(server.url, make_episodes(EPISODES, seed=1)))
    assert [e.reward for e in episodes].count(1.0) == EPISODES


@DELIVERY
def test_sigkilled_worker_gives_exactly_its_sessions_410(serve, handoff):
    server = serve_routed(serve, handoff)
    (runtime_dir,) = server.runtime_dirs()
    episodes = make_episodes(80, seed=3)
    cookies: dict[str, str] = {}

    async def request(client, path, episode, body=None):
        headers = {"Cookie": f"gym_session={cookies[episode.session_id]}"}
        async with client.post(server.url + path, json=body, headers=headers) as reply:
            episode.statuses.append(reply.status)
            return reply.status, await reply.json()

    async def start(client, e):
        body = {
            "resources_session_id": e.session_id,
            "options": {"initial_count": e.initial, "expected_count": e.expected},
        }
        async with client.post(server.url + "/reset", json=body) as reply:
            assert reply.status == 200
            cookies[e.session_id] = reply.cookies["gym_session"].value

    async def finish(client, e):
        for step in e.increments:
            await request(client, "/step", e, {"action": step})
        status, data = await request(client, "/verify", e)
        if status == 200:
            e.reward = data["reward"]
        await request(client, "/close_session", e, {"resources_session_id": e.session_id})

    async def scenario():
        async with client_session(fresh_connections=not handoff) as client:
            await asyncio.gather(*[start(client, e) for e in episodes])
            owners = {e.session_id: claim_owner(runtime_dir, e.session_id) for e in episodes}
            victim = max(set(owners.values()), key=list(owners.values()).count)
            os.kill(int(victim.split("-")[0]), signal.SIGKILL)
            await asyncio.sleep(0.5)
            await asyncio.gather(*[finish(client, e) for e in episodes])
            fresh = await asyncio.gather(
                *[play(client, server.url, e) for e in make_episodes(40, seed=4)]
            )
            return owners, victim, fresh

    owners, victim, fresh = asyncio.run(scenario())
    lost = [e for e in episodes if owners[e.session_id] == victim]
    kept = [e for e in episodes if owners[e.session_id] != victim]
    assert lost and kept
    for e in lost:  # every request, close included
        assert set(e.statuses) == {410}, e.statuses
    for e in kept:
        assert set(e.statuses) == {200} and e.reward == 1.0
    # uvicorn's replacement worker (a new id) and the others serve new sessions.
    assert [e.reward for e in fresh].count(1.0) == len(fresh)
    # The dead worker's claims stay (410) until the server exits with its directory.
    assert all(claim_owner(runtime_dir, e.session_id) == victim for e in lost)
    assert server.stop() == 0
    assert server.runtime_dirs() == []
