"""A counter-episode client that recovers requests lost to a killed worker, and counts them."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from envs.counter_load import Episode
from gym_sessions.wire import CLOSE_FOLLOWS_HEADER, EPISODE_LENGTH_HEADER, SESSION_COOKIE

#: The status recorded for a request whose connection the killed worker had accepted.
LOST = 0


def _code(data: Any) -> str | None:
    return data.get("error", {}).get("code") if isinstance(data, dict) else None


class DurablePlayer:
    """Plays counter episodes and recovers a request lost to the kill as `StepRecovery` does.

    A step whose reply failed (502/410: it was in flight on the worker that
    died, or the hop to it broke; or its connection was reset: the killed
    worker had accepted it) is followed by ``/observe``: an unchanged
    episode length means it did not run and it is sent again; one more means
    it ran. Every step carries its episode length (``x-gym-episode-length``),
    so a first send still on its way (held in a hop whose accepting worker
    died) and its resend never both run: the later one is refused (409
    ``step_out_of_order``), which for the resend means the step ran. Every
    such failure is counted on its episode.
    """

    #: How many times a failed ``/verify`` or ``/close_session`` is sent again.
    resends = 1
    resend_delay = 0.0

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url
        self.steps_done = 0
        self.killed = False
        #: Sessions still open when the kill came (started, not closed before it).
        self.open_at_kill: set[str] = set()
        self.failures: dict[str, list[tuple[str, int]]] = {}
        #: `/observe` requests of a recovery sent again (they reached the dying host).
        self.observe_resends = 0
        #: Resent steps refused because their first send ran after the `/observe`.
        self.late_sends = 0

    async def post(
        self, path: str, body: Any, cookie: str | None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, str | None]:
        send_headers = dict(headers or {})
        if cookie:
            send_headers["Cookie"] = f"{SESSION_COOKIE}={cookie}"
        try:
            async with self.client.post(self.url + path, json=body, headers=send_headers) as reply:
                try:
                    data = await reply.json(content_type=None)
                except ValueError:  # a proxy's own error page (nginx's 502)
                    data = await reply.text()
                morsel = reply.cookies.get(SESSION_COOKIE)
                return reply.status, data, morsel.value if morsel else cookie
        except aiohttp.ClientError as exc:
            # The worker that accepted this connection (or the hop behind a
            # proxy) was the one killed: reset, disconnected, reply cut short.
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
        self.open_at_kill.add(episode.session_id)
        return cookie

    async def _observe(self, cookie: str | None) -> tuple[Any, str | None]:
        """``/observe``, sent again while it fails the way a request to a dying host does.

        It only reads, so a resend is safe; a proxy may still pick the dying
        host (its 502) for a moment after the kill. Any other error fails.
        """
        for _ in range(20):
            status, data, cookie = await self.post("/observe", {}, cookie)
            if status == 200:
                return data, cookie
            assert status in (LOST, 502), data  # restored: never a 410 or 409 after the kill
            self.observe_resends += 1
            await asyncio.sleep(0.1)
        raise AssertionError("/observe kept failing after the kill")

    async def finish(self, episode: Episode, cookie: str) -> None:
        for length, action in enumerate(episode.increments):
            # Sent at its episode length: the server runs it at that length only.
            at_length = {EPISODE_LENGTH_HEADER: str(length)}
            resent = False
            while True:
                status, data, cookie = await self.post(
                    "/step", {"action": action}, cookie, at_length
                )
                if status == 200:
                    break
                if resent and status == 409 and _code(data) == "step_out_of_order":
                    self.late_sends += 1
                    break  # the first send, held up in a hop, ran after the /observe
                self._failed(episode, "/step", status)
                data, cookie = await self._observe(cookie)
                if data["episode_length"] == length + 1:
                    break  # it ran before the worker died
                assert data["episode_length"] == length
                resent = True
            self.steps_done += 1
            await asyncio.sleep(0.01)  # think: episodes are still open when the kill comes
        status, data, cookie = await self.post("/verify", {}, cookie, {CLOSE_FOLLOWS_HEADER: "1"})
        for _ in range(self.resends):
            if status == 200:
                break
            # verify with close-follows only reads: send it again
            self._failed(episode, "/verify", status)
            await asyncio.sleep(self.resend_delay)
            status, data, cookie = await self.post(
                "/verify", {}, cookie, {CLOSE_FOLLOWS_HEADER: "1"}
            )
        assert status == 200, data
        episode.reward = data["reward"]
        close = {"resources_session_id": episode.session_id, "session_key": episode.session_key}
        if not self.killed:
            self.open_at_kill.discard(episode.session_id)
        status, data, _ = await self.post("/close_session", close, cookie)
        if status == 200:
            assert data["outcome"] == "closed", data
            return
        for _ in range(self.resends):
            # In flight at the kill: a close is idempotent, send it again. If
            # the dead worker ran it, its snapshot went with it: 410 then (or,
            # restored elsewhere before, already_closed).
            self._failed(episode, "/close_session", status)
            await asyncio.sleep(self.resend_delay)
            status, data, _ = await self.post("/close_session", close, cookie)
            if status in (200, 410):
                break
        assert status in (200, 410), data
