"""The stress suite's checks, each a row: correct of total, and wall time.

Each check runs against real server processes that the caller starts
(`run_suite` starts them all). Sizes are parameters: the opt-in run uses the
reference's sizes, the default test suite a few hundred.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import redis.asyncio

from envs.counter_load import (
    Episode,
    claim_owner,
    client_session,
    make_episodes,
    play,
    play_over_mcp,
)
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.server_process import ServerProcess
from tests.stress.targets import FAULT_HEADER, MARK_HEADER, mark_path

COOKIE = "gym_session"
# Bounds, never expectations: a held-back reply's marker appears within this long
# (its request may queue behind a burst of others on a loaded machine) ...
MARK_WITHIN_SECONDS = 60.0
# ... and a SIGKILLed worker is dead within this long.
DEATH_WITHIN_SECONDS = 30.0


@dataclass
class Row:
    """One check's result."""

    check: str
    correct: int
    total: int
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.correct == self.total

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


async def _timed(check: str, total: int, work: Callable[[], Awaitable[tuple[int, dict]]]) -> Row:
    started = time.perf_counter()
    correct, detail = await work()
    return Row(check, correct, total, time.perf_counter() - started, detail)


async def _json(reply: aiohttp.ClientResponse) -> Any:
    return await reply.json(content_type=None)


async def worker_healths(
    server: ServerProcess, workers: int, within: float = 15.0, batch: int = 16
) -> dict[str, dict]:
    """``/health`` of every live worker, probed on new connections (bounded in time).

    Probes go out ``batch`` at a time: one connection after another tends to
    reach the same awake worker, so sequential probes can miss one for long.
    """
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + within
    async with client_session() as client:

        async def probe() -> dict:
            async with client.get(server.url + "/health") as reply:
                return await _json(reply)

        while len(seen) < workers and time.monotonic() < deadline:
            for health in await asyncio.gather(*[probe() for _ in range(batch)]):
                seen[health["worker"]] = health
    return seen


# /run episodes through the agent ------------------------------------------------------------


async def run_episodes(agent_url: str, env_url: str, n: int, *, limit: int = 512) -> Row:
    episodes = make_episodes(n, seed=n)

    async def work() -> tuple[int, dict]:
        async with client_session(fresh_connections=False, limit=limit) as client:

            async def one(episode: Episode) -> bool:
                body = {"env_url": env_url, "task": episode.task}
                try:
                    async with client.post(agent_url + "/run", json=body) as reply:
                        data = await _json(reply)
                        return reply.status == 200 and data["reward"] == 1.0
                except aiohttp.ClientError:
                    return False

            done = await asyncio.gather(*[one(e) for e in episodes])
        return sum(done), {}

    return await _timed(f"{n:,} concurrent /run episodes, reward 1.0", n, work)


# Seeds that fail with 500 and no cookie, cleanup close, new attempt ----------------------------


async def failed_seeds(env_url: str, n: int) -> Row:
    async def one(client: aiohttp.ClientSession, episode: Episode) -> bool:
        failing = {"resources_session_id": uuid.uuid4().hex, "session_key": episode.session_key}
        body = {**failing, "options": {"fail": True}}
        async with client.post(env_url + "/seed_session", json=body) as reply:
            data = await _json(reply)
            if reply.status != 500 or data["error"]["code"] != "env_error":
                return False
        async with client.post(env_url + "/close_session", json=failing) as reply:
            closed = await _json(reply)
        if closed.get("outcome") != "closed":
            return False
        await play(client, env_url, episode)
        return episode.reward == 1.0

    async def work() -> tuple[int, dict]:
        async with client_session() as client:
            done = await asyncio.gather(*[one(client, e) for e in make_episodes(n, seed=11)])
        return sum(done), {}

    return await _timed("seeds failing with 500, cookieless cleanup close, new attempt", n, work)


# Seeds whose first reply is dropped or cut off, retried without a cookie -----------------------


class _Marks:
    """Watches the marker directory: a held-back reply's marker means its start has run."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.waiting: dict[str, asyncio.Event] = {}

    def expect(self, mark: str) -> asyncio.Event:
        self.waiting[mark] = event = asyncio.Event()
        return event

    async def watch(self) -> None:
        while True:
            if self.waiting:
                present = set(os.listdir(self.directory))
                for mark in [m for m in self.waiting if m in present]:
                    self.waiting.pop(mark).set()
            await asyncio.sleep(0.01)


async def dropped_replies(env_url: str, n: int, fault_dir: str) -> Row:
    """A start whose reply the client never sees (or sees cut) is retried by id and key alone.

    The first attempt's reply is broken only after the server ran the start:
    ``cut`` sends the headers (status 200) and half the body; ``delay`` holds
    the whole reply back until the client, told by a marker file in
    ``fault_dir`` that the start ran, has closed the connection
    (tests/stress/targets.py). Only then is the retry sent: the same typed id
    and session key, no cookie. It must reach the same session (every status
    200, the same id) and the episode must score 1.0. No step depends on how
    fast the machine is; the detail counts each kind of failure.
    """
    marks = _Marks(fault_dir)
    failures: dict[str, int] = {}

    def failed(reason: str) -> bool:
        failures[reason] = failures.get(reason, 0) + 1
        return False

    async def drop_after_run(client: aiohttp.ClientSession, body: dict) -> str | None:
        mark = uuid.uuid4().hex
        ran = marks.expect(mark)
        headers = {FAULT_HEADER.decode(): "delay", MARK_HEADER.decode(): mark}

        async def send() -> None:
            async with client.post(env_url + "/seed_session", json=body, headers=headers) as r:
                await r.read()

        request = asyncio.create_task(send())
        waiting = asyncio.create_task(ran.wait())
        try:
            await asyncio.wait(
                {request, waiting},
                timeout=MARK_WITHIN_SECONDS,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if request.done():  # a reply or an error, while the server should hold it back
                return "first reply arrived" if request.exception() is None else "first failed"
            if not ran.is_set():
                return "no marker: the start never ran"
            return None
        finally:
            marks.waiting.pop(mark, None)
            for task in (request, waiting):
                task.cancel()  # cancelling the request closes its connection: the reply is lost
            await asyncio.gather(request, waiting, return_exceptions=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(mark_path(fault_dir, mark))  # only now is the reply sent, into the void

    async def cut_after_run(client: aiohttp.ClientSession, body: dict) -> str | None:
        headers = {FAULT_HEADER.decode(): "cut"}
        try:
            async with client.post(env_url + "/seed_session", json=body, headers=headers) as r:
                if r.status != 200:
                    return f"first reply {r.status}"
                await r.read()
            return "first reply arrived whole"
        except aiohttp.ClientPayloadError:
            return None  # the headers say the start ran; the body was cut
        except aiohttp.ClientError:
            return "first failed before its headers"

    async def one(client: aiohttp.ClientSession, episode: Episode, fault: str) -> bool:
        body = {
            "resources_session_id": episode.session_id,
            "session_key": episode.session_key,
            "options": {"initial_count": episode.initial, "expected_count": episode.expected},
        }
        first = drop_after_run if fault == "delay" else cut_after_run
        problem = await first(client, body)
        if problem is not None:
            return failed(f"{fault}: {problem}")
        named = episode.session_id
        await play(client, env_url, episode)  # the retry: same typed id and key, no cookie
        if episode.session_id != named or any(s != 200 for s in episode.statuses):
            return failed(f"{fault}: retry refused or another session {episode.error_codes}")
        return episode.reward == 1.0 or failed(f"{fault}: retried episode scored {episode.reward}")

    async def work() -> tuple[int, dict]:
        watcher = asyncio.create_task(marks.watch())
        try:
            async with client_session() as client:
                episodes = make_episodes(n, seed=12)
                done = await asyncio.gather(
                    *[one(client, e, "delay" if i % 2 else "cut") for i, e in enumerate(episodes)]
                )
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        return sum(done), {"failures": failures} if failures else {}

    return await _timed("seeds whose first reply is dropped or cut, retried", n, work)


# A cleanup close before its delayed seed --------------------------------------------------------


async def close_before_seed(env_url: str, n: int) -> Row:
    async def one(client: aiohttp.ClientSession) -> bool:
        names = {"resources_session_id": uuid.uuid4().hex, "session_key": uuid.uuid4().hex}
        async with client.post(env_url + "/close_session", json=names) as r:
            if (await _json(r)).get("outcome") != "closed":
                return False
        async with client.post(env_url + "/seed_session", json=names) as r:
            data = await _json(r)
            return r.status == 409 and data["error"]["code"] == "session_closed"

    async def work() -> tuple[int, dict]:
        async with client_session() as client:
            done = await asyncio.gather(*[one(client) for _ in range(n)])
        return sum(done), {}

    return await _timed("cleanup close before its delayed seed: seed refused", n, work)


# Untyped seeds that never read the session, then tool calls ------------------------------------


async def blind_starts(tally: ServerProcess, workers: int, n: int, calls: int = 5) -> Row:
    async def one(client: aiohttp.ClientSession) -> bool:
        async with client.post(tally.url + "/seed_session", json={}) as reply:
            morsel = reply.cookies.get(COOKIE)
        if morsel is None:
            return False
        headers = {"Cookie": f"{COOKIE}={morsel.value}"}
        for _ in range(calls):
            async with client.post(tally.url + "/add", json={}, headers=headers) as reply:
                await reply.read()
        async with client.post(tally.url + "/total", json={}, headers=headers) as reply:
            return (await _json(reply)).get("total") == calls

    async def work() -> tuple[int, dict]:
        before = sum(h["created"] for h in (await worker_healths(tally, workers)).values())
        async with client_session() as client:
            done = await asyncio.gather(*[one(client) for _ in range(n)])
        after = await worker_healths(tally, workers)
        created = sum(h["created"] for h in after.values()) - before
        # One state per session: a session split over workers would be created twice.
        split = created - n
        return (sum(done) if split == 0 else 0), {"states_created": created, "split": split}

    return await _timed(
        f"untyped seeds that never read the session, {calls} tool calls, a read", n, work
    )


# MCP sequences with only the token --------------------------------------------------------------


async def mcp_sequences(env_url: str, n: int) -> Row:
    async def work() -> tuple[int, dict]:
        async with client_session() as client:
            done = await asyncio.gather(
                *[play_over_mcp(client, env_url, e) for e in make_episodes(n, seed=13)]
            )
        # These sequences never close: close them so no session is left behind.
        async with client_session() as client:
            for e in done:
                names = {"resources_session_id": e.session_id, "session_key": e.session_key}
                async with client.post(env_url + "/close_session", json=names) as reply:
                    await reply.read()
        return sum(e.reward == 1.0 for e in done), {}

    return await _timed("MCP sequences with only the session token", n, work)


# Live sessions and claims left ------------------------------------------------------------------


async def live_sessions_left(server: ServerProcess, workers: int) -> Row:
    async def work() -> tuple[int, dict]:
        healths = await worker_healths(server, workers)
        live = sum(h["sessions"] for h in healths.values())
        return (1 if live == 0 and len(healths) == workers else 0), {
            "live_sessions": live,
            "workers_seen": len(healths),
        }

    return await _timed("live sessions left after every close: none", 1, work)


async def claims_left(server: ServerProcess, window: float) -> Row:
    async def work() -> tuple[int, dict]:
        await asyncio.sleep(window + 1.0)
        left = len(server.claim_files())
        return (1 if left == 0 else 0), {"claims_left": left}

    return await _timed(f"claims left {window + 1:.0f} s after the run: none", 1, work)


async def redis_claims_left(redis_url: str, window: float) -> Row:
    """No claim left in Redis a window after the run (Redis claims: several hosts)."""

    async def work() -> tuple[int, dict]:
        await asyncio.sleep(window + 1.0)
        client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        try:
            left = [key async for key in client.scan_iter(match=RedisClaimStore.claim_prefix + "*")]
        finally:
            await client.aclose()
        return (1 if not left else 0), {"claims_left": len(left)}

    return await _timed(f"Redis claims left {window + 1:.0f} s after the run: none", 1, work)


# A worker SIGKILLed with sessions open ----------------------------------------------------------


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


async def _wait_dead(pid: int, within: float) -> float | None:
    """Seconds until ``pid`` had exited (polled), or ``None`` if it had not within ``within``."""
    started = time.monotonic()
    while not _dead(pid):
        if time.monotonic() - started > within:
            return None
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def killed_worker(server: ServerProcess, n: int) -> Row:
    (runtime_dir,) = server.runtime_dirs()
    episodes = make_episodes(n, seed=14)

    async def work() -> tuple[int, dict]:
        async with client_session() as client:
            cookies: dict[str, str] = {}

            async def start(e: Episode) -> None:
                body = {
                    "resources_session_id": e.session_id,
                    "session_key": e.session_key,
                    "options": {"initial_count": e.initial, "expected_count": e.expected},
                }
                async with client.post(server.url + "/reset", json=body) as reply:
                    cookies[e.session_id] = reply.cookies[COOKIE].value

            await asyncio.gather(*[start(e) for e in episodes])
            owners = {e.session_id: claim_owner(runtime_dir, e.session_id) for e in episodes}
            victim = max(set(owners.values()), key=list(owners.values()).count)
            victim_pid = int(victim.split("-")[0])
            os.kill(victim_pid, signal.SIGKILL)
            # Its descriptors (the private socket's listener) are closed once it is dead.
            dead_after = await _wait_dead(victim_pid, DEATH_WITHIN_SECONDS)

            async def finish(e: Episode) -> None:
                headers = {"Cookie": f"{COOKIE}={cookies[e.session_id]}"}
                for step in e.increments:
                    async with client.post(
                        server.url + "/step", json={"action": step}, headers=headers
                    ) as reply:
                        e.statuses.append(reply.status)
                async with client.post(server.url + "/verify", json={}, headers=headers) as reply:
                    e.statuses.append(reply.status)
                    if reply.status == 200:
                        e.reward = (await _json(reply))["reward"]
                names = {"resources_session_id": e.session_id, "session_key": e.session_key}
                async with client.post(server.url + "/close_session", json=names) as reply:
                    e.statuses.append(reply.status)

            await asyncio.gather(*[finish(e) for e in episodes])
        lost = [e for e in episodes if owners[e.session_id] == victim]
        correct = sum(
            set(e.statuses) == {410}
            if owners[e.session_id] == victim
            else (set(e.statuses) == {200} and e.reward == 1.0)
            for e in episodes
        )
        claims_kept = sum(claim_owner(runtime_dir, e.session_id) == victim for e in lost)
        return correct, {
            "victim_dead_after_seconds": dead_after,
            "victim_sessions": len(lost),
            "victim_claims_kept_until_exit": claims_kept,
            "runtime_dir": runtime_dir,
        }

    return await _timed("worker SIGKILLed: its sessions 410, the rest 1.0", n, work)
