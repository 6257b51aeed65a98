"""Durable sessions with real ``gym-sessions serve --workers 4 --durable-sessions`` processes."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import aiohttp
import pytest

from envs.counter_load import Episode, claim_owner, client_session, make_episodes
from gym_sessions.routing.runtime_dir import RuntimeDirectory
from gym_sessions.wire import CLOSE_FOLLOWS_HEADER, SESSION_COOKIE

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
EPISODES = 200
#: The status recorded for a request whose connection the killed worker had accepted.
LOST = 0


class DurablePlayer:
    """Plays counter episodes and recovers a request lost to the kill as `StepRecovery` does.

    A step whose reply failed (502/410: it was in flight on the worker that
    died, or the hop to it broke; or its connection was reset: the killed
    worker had accepted it) is followed by ``/observe``: an unchanged
    episode length means it did not run and it is sent again; one more means
    it ran. Every such failure is counted on its episode.
    """

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url
        self.steps_done = 0
        self.killed = False
        #: Sessions still open when the kill came.
        self.open_at_kill: set[str] = set()
        self.failures: dict[str, list[tuple[str, int]]] = {}

    async def post(
        self, path: str, body: Any, cookie: str | None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, str | None]:
        send_headers = dict(headers or {})
        if cookie:
            send_headers["Cookie"] = f"{SESSION_COOKIE}={cookie}"
        try:
            async with self.client.post(self.url + path, json=body, headers=send_headers) as reply:
                data = await reply.json(content_type=None)
                morsel = reply.cookies.get(SESSION_COOKIE)
                return reply.status, data, morsel.value if morsel else cookie
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:
            # The worker that accepted this connection was the one killed.
            return LOST, repr(exc), cookie

    def _failed(self, episode: Episode, path: str, status: int) -> None:
        self.failures.setdefault(episode.session_id, []).append((path, status))

    async def start(self, episode: Episode) -> str:
        body = {
            "resources_session_id": episode.session_id,
            "session_key": episode.session_key,
            "options": {"initial_count": episode.initial, "expected_count": episode.expected},
        }
        status, data, cookie = await self.post("/reset", body, None)
        assert status == 200, data
        assert cookie is not None
        return cookie

    async def finish(self, episode: Episode, cookie: str) -> None:
        for length, action in enumerate(episode.increments):
            while True:
                status, data, cookie = await self.post("/step", {"action": action}, cookie)
                if status == 200:
                    break
                self._failed(episode, "/step", status)
                status, data, cookie = await self.post("/observe", {}, cookie)
                assert status == 200, data  # restored: never an error after the kill
                if data["episode_length"] == length + 1:
                    break  # it ran before the worker died
                assert data["episode_length"] == length
            self.steps_done += 1
            await asyncio.sleep(0.01)  # think: episodes are still open when the kill comes
        status, data, cookie = await self.post("/verify", {}, cookie, {CLOSE_FOLLOWS_HEADER: "1"})
        if status != 200:  # verify with close-follows only reads: send it again
            self._failed(episode, "/verify", status)
            status, data, cookie = await self.post(
                "/verify", {}, cookie, {CLOSE_FOLLOWS_HEADER: "1"}
            )
        assert status == 200, data
        episode.reward = data["reward"]
        close = {"resources_session_id": episode.session_id, "session_key": episode.session_key}
        if not self.killed:
            self.open_at_kill.discard(episode.session_id)
        status, data, _ = await self.post("/close_session", close, cookie)
        assert status == 200, data


def test_sigkilled_worker_mid_episodes_loses_no_durable_session(serve):
    server = serve(COUNTER, "--durable-sessions", workers=4)
    (runtime_dir,) = server.runtime_dirs()
    episodes = make_episodes(EPISODES, seed=16)

    async def scenario() -> tuple[DurablePlayer, dict[str, str | None], str]:
        async with client_session() as client:
            player = DurablePlayer(client, server.url)
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            player.open_at_kill = {e.session_id for e in episodes}
            owners = {e.session_id: claim_owner(runtime_dir, e.session_id) for e in episodes}
            victim = max(set(owners.values()), key=list(owners.values()).count)
            assert victim is not None
            total = sum(len(e.increments) for e in episodes)

            async def kill_midway() -> None:
                while player.steps_done < total // 3:  # noqa: ASYNC110 (a count, not an event)
                    await asyncio.sleep(0.005)
                os.kill(int(victim.split("-")[0]), signal.SIGKILL)
                player.killed = True

            await asyncio.gather(
                kill_midway(),
                *[player.finish(e, c) for e, c in zip(episodes, cookies, strict=True)],
            )
            return player, owners, victim

    player, owners, victim = asyncio.run(scenario())
    assert [e.reward for e in episodes].count(1.0) == EPISODES
    assert any(owner == victim for owner in owners.values())
    # Failures only where a request was in flight on the victim at the kill
    # (each episode has one request at a time): at most one per episode, and
    # only a reset connection or 502/410 (the hop broke mid-request).
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 410, 502), failures
    # The victim's sessions open at the kill were taken over (their claims,
    # kept a window after the close, name the worker that restored them).
    taken_over = {s for s in player.open_at_kill if owners[s] == victim}
    assert taken_over
    assert not [s for s in taken_over if claim_owner(runtime_dir, s) in (victim, None)]
    # Every session is closed: its snapshot went with it.
    assert RuntimeDirectory(runtime_dir).snapshot_count() == 0
    assert server.stop() == 0
