"""The stress suite's checks, each a row: correct of total, and wall time.

Each check runs against real server processes that the caller starts
(`run_suite` starts them all). Sizes are parameters: the opt-in run uses the
reference's sizes, the default test suite a few hundred. The multi-host faults
(a long step, deleted, forged or frozen Redis entries) play episodes that
compare every observation with the count it should be and retry 503s whose
request never ran, as a client does; each records its recovery times.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import redis.asyncio

from envs.counter_load import (
    Episode,
    client_session,
    make_episodes,
    play,
    play_over_mcp,
)
from gym_sessions.routing.keys import REGISTRATION_PREFIX
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.server.process import ServerProcess
from tests.services import claim_owner
from tests.stress.targets import FAULT_HEADER, MARK_HEADER, SLOW_STEP_SECONDS, mark_path

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


# Multi-host faults: episodes that check every observation and retry 503s ---------------------

#: 503s whose request never ran (the claim store or the worker's room was out of
#: reach): a client retries them, and the checks count them in their detail.
RETRIED_CODES = frozenset({"claims_unavailable", "overloaded"})
RETRY_PAUSE_SECONDS = 0.1
# A bound, never an expectation: a request still refused after this long fails.
RETRY_WITHIN_SECONDS = 60.0
# How long the forger keeps its entries in Redis, and how long Redis stays frozen.
FORGED_SECONDS = 3.0
FROZEN_SECONDS = 5.0
# Freezing Redis: episodes start over this long, Redis stops this far into it.
FREEZE_SPREAD_SECONDS = 8.0
FREEZE_AFTER_SECONDS = 2.0
# ... and each pauses this long before each step, so the freeze finds many mid-episode.
FREEZE_STEP_PAUSE_SECONDS = 0.5
# Compare-and-set, so restoring never overwrites what a worker wrote meanwhile.
_SWAP_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'KEEPTTL')
  return 1
end
return 0
"""


@dataclass
class _Sent:
    started: float
    ended: float
    status: int
    code: str | None


@dataclass
class _Checked:
    """A counter episode whose every observation is compared with the count it should be."""

    episode: Episode
    cookie: str | None = None
    wrong_observations: int = 0

    @property
    def right(self) -> bool:
        """Every answer 200 (after retried 503s), every observation right, reward 1.0.

        A second env for the session (a split) shows as a wrong observation or
        ``no_open_episode``; a session taken for gone as 410.
        """
        e = self.episode
        return e.reward == 1.0 and self.wrong_observations == 0 and set(e.statuses) == {200}


def _error_code(status: int, data: Any) -> str | None:
    if status == 200:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else f"http {status}"


class _Player:
    """Plays `_Checked` episodes against ``url``, retrying 503s whose request never ran.

    Keeps every request sent (retries included) and, for each request that was
    retried, when it was first refused and when it was answered: the checks'
    recovery times.
    """

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url
        self.sent: list[_Sent] = []
        self.retried: list[tuple[float, float]] = []

    async def _once(
        self, path: str, body: Any, headers: dict[str, str]
    ) -> tuple[int, Any, str | None]:
        try:
            async with self.client.post(self.url + path, json=body, headers=headers) as reply:
                text = await reply.text()
                morsel = reply.cookies.get(COOKIE)
                status = reply.status
        except aiohttp.ClientError as exc:
            return 0, {"error": {"code": f"client {type(exc).__name__}"}}, None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        return status, data, morsel.value if morsel else None

    async def post(
        self, run: _Checked, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> Any:
        """The reply's JSON if it was 200, else ``None`` (its status and code on the episode)."""
        first = time.monotonic()
        deadline = first + RETRY_WITHIN_SECONDS
        retried = False
        while True:
            send_headers = dict(headers or {})
            if run.cookie:
                send_headers["Cookie"] = f"{COOKIE}={run.cookie}"
            started = time.monotonic()
            status, data, cookie = await self._once(path, body, send_headers)
            code = _error_code(status, data)
            ended = time.monotonic()
            self.sent.append(_Sent(started, ended, status, code))
            if status == 503 and code in RETRIED_CODES and ended < deadline:
                retried = True
                await asyncio.sleep(RETRY_PAUSE_SECONDS)
                continue
            if retried:
                self.retried.append((first, ended))
            run.episode.statuses.append(status)
            if code is not None:
                run.episode.error_codes.append(code)
            if cookie:
                run.cookie = cookie
            return data if status == 200 else None

    async def start(self, run: _Checked) -> bool:
        e = run.episode
        body = {
            "resources_session_id": e.session_id,
            "session_key": e.session_key,
            "options": {"initial_count": e.initial, "expected_count": e.expected},
        }
        return await self.post(run, "/reset", body) is not None

    async def step(self, run: _Checked, index: int, headers: dict[str, str] | None = None) -> bool:
        e = run.episode
        data = await self.post(run, "/step", {"action": e.increments[index]}, headers)
        if data is None:
            return False
        if data.get("observation") != e.initial + sum(e.increments[: index + 1]):
            run.wrong_observations += 1
        return True

    async def steps(self, run: _Checked, first: int = 0, pause: float = 0.0) -> bool:
        """Step from increment ``first`` on, ``pause`` seconds before each; False on a failure."""
        for index in range(first, len(run.episode.increments)):
            await asyncio.sleep(pause)
            if not await self.step(run, index):
                return False
        return True

    async def finish(self, run: _Checked) -> None:
        """Verify (a close follows) and close by id and key."""
        data = await self.post(run, "/verify", {}, {"x-gym-close-follows": "1"})
        if data is not None:
            run.episode.reward = data.get("reward")
        e = run.episode
        names = {"resources_session_id": e.session_id, "session_key": e.session_key}
        await self.post(run, "/close_session", names)

    async def play(self, run: _Checked, pause: float = 0.0) -> None:
        if await self.start(run) and await self.steps(run, pause=pause):
            await self.finish(run)

    def detail(self, since: float | None = None) -> dict[str, Any]:
        """What the requests met: answers other than 200, the longest request and retry wait.

        Args:
            since: The moment the fault was undone: adds how long after it the
                last request that was being retried then was answered.
        """
        refused: dict[str, int] = {}
        for sent in self.sent:
            if sent.status != 200:
                key = f"{sent.status} {sent.code}"
                refused[key] = refused.get(key, 0) + 1
        detail: dict[str, Any] = {
            "requests": len(self.sent),
            "not_200": refused,
            "longest_request_seconds": _rounded(
                max((s.ended - s.started for s in self.sent), default=0.0)
            ),
            "retried_requests": len(self.retried),
            "longest_retry_wait_seconds": _rounded(
                max((e - f for f, e in self.retried), default=0.0)
            ),
        }
        if since is not None:
            waiting = [ended for first, ended in self.retried if first <= since <= ended]
            detail["retried_answered_after_fault_seconds"] = (
                _rounded(max(waiting) - since) if waiting else None
            )
        return detail


def _rounded(seconds: float) -> float:
    return round(seconds, 2)


def _wrong(runs: list[_Checked], limit: int = 5) -> list[dict[str, Any]]:
    """A few failed episodes, for the detail."""
    return [
        {
            "statuses": r.episode.statuses,
            "codes": r.episode.error_codes,
            "reward": r.episode.reward,
            "wrong_observations": r.wrong_observations,
        }
        for r in runs
        if not r.right
    ][:limit]


async def _claim_values(client: redis.asyncio.Redis, session_ids: list[str]) -> list[str | None]:
    if not session_ids:
        return []
    return await client.mget([RedisClaimStore.key(sid) for sid in session_ids])


def _owner(value: str | None) -> str | None:
    return None if value is None else value.split("|", 1)[0]


# A long step blocking one worker of each host ------------------------------------------------


async def long_steps(
    url: str, redis_url: str, hosts: list[ServerProcess], fault_dir: str, n: int
) -> Row:
    """Episodes on both hosts while a 12 s step blocks one worker's event loop on each.

    After the starts, one session of the busiest worker of each host sends a
    ``slow-step`` step (tests/stress/targets.py); once both slow steps run
    (their marker files), every other episode plays on. The blocked workers'
    other sessions must wait and get 200, never 410: a thread renews each
    worker's registration, so a busy worker is never taken for gone. Correct:
    the episodes (blockers included) whose every answer was 200, every
    observation right, reward 1.0. The detail says whether the blocked workers
    stayed registered (sampled every 0.5 s) and how long their sessions waited.
    """
    runs = [_Checked(e) for e in make_episodes(n, seed=15)]
    marks = _Marks(fault_dir)

    async def work() -> tuple[int, dict]:
        store = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        watcher = asyncio.create_task(marks.watch())
        problems: list[str] = []
        slow_seconds: list[float] = []
        registered: list[bool] = []
        used_marks: list[str] = []
        try:
            async with client_session(limit=256) as client:
                player, slow_player = _Player(client, url), _Player(client, url)
                started = await asyncio.gather(*[player.start(r) for r in runs])
                live = [r for r, ok in zip(runs, started, strict=True) if ok]
                owners = [
                    _owner(v)
                    for v in await _claim_values(store, [r.episode.session_id for r in live])
                ]
                blockers = _busiest_per_host(live, owners, hosts)
                blocked_workers = {owner for _, owner in blockers}

                async def block(run: _Checked, mark: str) -> None:
                    headers = {FAULT_HEADER.decode(): "slow-step", MARK_HEADER.decode(): mark}
                    began = time.monotonic()
                    ok = await slow_player.step(run, 0, headers)
                    slow_seconds.append(_rounded(time.monotonic() - began))
                    if ok and await slow_player.steps(run, 1):
                        await slow_player.finish(run)

                mark_events, blocking = [], []
                for run, _ in blockers:
                    mark = uuid.uuid4().hex
                    used_marks.append(mark)
                    mark_events.append(marks.expect(mark))
                    blocking.append(asyncio.create_task(block(run, mark)))
                try:
                    async with asyncio.timeout(MARK_WITHIN_SECONDS):
                        await asyncio.gather(*[event.wait() for event in mark_events])
                except TimeoutError:
                    problems.append("a slow step never ran")

                async def sample_registrations() -> None:
                    keys = [REGISTRATION_PREFIX + w for w in blocked_workers]
                    while keys and not all(task.done() for task in blocking):
                        registered.append(await store.exists(*keys) == len(keys))
                        await asyncio.sleep(0.5)

                others = [r for r in live if all(r is not b for b, _ in blockers)]

                async def play_on(run: _Checked) -> None:
                    if await player.steps(run):
                        await player.finish(run)

                await asyncio.gather(
                    sample_registrations(), *blocking, *[play_on(r) for r in others]
                )
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await store.aclose()
            for mark in used_marks:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(mark_path(fault_dir, mark))
        if len(blockers) != len(hosts):
            problems.append(f"found a busy worker on {len(blockers)} of {len(hosts)} hosts")
        correct = sum(r.right for r in runs) if not problems else 0
        return correct, {
            **({"problems": problems} if problems else {}),
            "blocked_workers": sorted(blocked_workers),
            "slow_step_seconds": slow_seconds,
            "blocked_workers_always_registered": all(registered),
            "registration_samples": len(registered),
            # Requests of other sessions that waited for a blocked worker.
            "others_waited_past_half_the_step": sum(
                s.ended - s.started > SLOW_STEP_SECONDS / 2 for s in player.sent
            ),
            "others": player.detail(),
            "wrong": _wrong(runs),
        }

    return await _timed(
        f"long steps ({SLOW_STEP_SECONDS:g} s, one worker per host) beside live sessions: "
        "all 200, never 410",
        n,
        work,
    )


def _busiest_per_host(
    runs: list[_Checked], owners: list[str | None], hosts: list[ServerProcess]
) -> list[tuple[_Checked, str]]:
    """For each host, one session of its worker with the most sessions, and that worker."""
    chosen = []
    for host in hosts:
        pids = set(host.worker_pids())
        mine = [
            (run, owner)
            for run, owner in zip(runs, owners, strict=True)
            if owner is not None and int(owner.split("-")[0]) in pids
        ]
        if not mine:
            continue
        counts: dict[str, int] = {}
        for _, owner in mine:
            counts[owner] = counts.get(owner, 0) + 1
        busiest = max(counts, key=counts.__getitem__)
        chosen.append(next((run, owner) for run, owner in mine if owner == busiest))
    return chosen


# Claim keys deleted while episodes run -------------------------------------------------------


async def claims_deleted(url: str, redis_url: str, n: int) -> Row:
    """A third of the claim keys in Redis deleted every 50 ms while ``n`` episodes run.

    A claim that vanished while its holder's index lists it is written back
    for that holder, never claimed anew elsewhere: no session may get a second
    env. Correct: episodes whose every answer was 200 (after retried 503s),
    every observation the count it should be, reward 1.0.
    """
    runs = [_Checked(e) for e in make_episodes(n, seed=16)]

    async def work() -> tuple[int, dict]:
        done = asyncio.Event()
        deleted = rounds = 0

        async def vandal() -> None:
            nonlocal deleted, rounds
            rng = random.Random(16)
            client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
            deadline = time.monotonic() + RETRY_WITHIN_SECONDS * 5
            try:
                while not done.is_set() and time.monotonic() < deadline:
                    keys = await _scan_claims(client)
                    victims = rng.sample(keys, len(keys) // 3)
                    if victims:
                        deleted += await client.delete(*victims)
                    rounds += 1
                    await asyncio.sleep(0.05)
            finally:
                await client.aclose()

        async with client_session() as client:
            player = _Player(client, url)
            deleting = asyncio.create_task(vandal())
            try:
                await asyncio.gather(*[player.play(r) for r in runs])
            finally:
                done.set()
                await deleting
        correct = sum(r.right for r in runs)
        return correct, {
            "claims_deleted": deleted,
            "deletion_rounds": rounds,
            **player.detail(),
            "wrong": _wrong(runs),
        }

    return await _timed("claim keys deleted under load: one env per session, 1.0", n, work)


async def _scan_claims(client: redis.asyncio.Redis) -> list[str]:
    pattern = RedisClaimStore.claim_prefix + "*"
    return [key async for key in client.scan_iter(match=pattern, count=1000)]


# Forged claims and registrations -------------------------------------------------------------


@contextlib.asynccontextmanager
async def _trap() -> AsyncIterator[tuple[int, list[int]]]:
    """A listener on loopback that counts the connections it gets: its port and the count."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], connections
    finally:
        server.close()
        await server.wait_closed()


def _forgeries(values: list[str], trap: str) -> list[str]:
    """Forged claim values, one per genuine one, of three kinds in turn.

    The genuine worker with the trap's address and the genuine MAC; a made-up
    MAC; another session's genuine value (a real worker, signed for another
    claim name).
    """
    forged = []
    for i, value in enumerate(values):
        worker, _, rest = value.partition("|")
        mac = rest.rpartition("|")[2]
        kind = i % 3
        if kind == 0:
            forged.append(f"{worker}|{trap}|{mac}")
        elif kind == 1:
            forged.append(f"{worker}|{trap}|{'0' * 32}")
        else:
            others = [v for v in values if _owner(v) != worker] or [v for v in values if v != value]
            forged.append(others[i % len(others)] if others else f"{worker}|{trap}|{'f' * 32}")
    return forged


async def forged_entries(url: str, redis_url: str, n: int) -> Row:
    """Claims and registrations rewritten without the secret, pointing at a trap, mid-episode.

    After the starts, half the sessions' claims get forged values (the trap's
    address with the genuine MAC, a made-up MAC, or another session's genuine
    value); then the steps run while half the workers' registrations point at
    the trap, rewritten every 0.2 s against their heartbeats, for
    `FORGED_SECONDS` (503s retried). Then the forger puts the genuine values
    back (compare-and-set) and the episodes verify and close. Correct:
    episodes with every answer 200, every observation right, reward 1.0,
    provided the trap got no connection at all (else none).

    No episode closes while its claim is forged: its claimant would take the
    forged value for another worker's claim, forget the session and leave the
    key (with the genuine value put back, a claim nobody holds or expires).
    """
    runs = [_Checked(e) for e in make_episodes(n, seed=17)]

    async def work() -> tuple[int, dict]:
        store = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
        swap = store.register_script(_SWAP_LUA)
        restored = asyncio.Event()
        counts = {"claims_forged": 0, "claims_restored": 0, "registration_forgeries": 0}
        restored_at = float("inf")
        try:
            async with _trap() as (port, connections), client_session() as client:
                trap = f"127.0.0.1:{port}"
                player = _Player(client, url)
                started = await asyncio.gather(*[player.start(r) for r in runs])
                live = [r for r, ok in zip(runs, started, strict=True) if ok]
                chosen = [RedisClaimStore.key(r.episode.session_id) for r in live][::2]
                held = [(k, v) for k, v in zip(chosen, await store.mget(chosen), strict=True) if v]
                keys, genuine = [k for k, _ in held], [v for _, v in held]
                forged = _forgeries(genuine, trap)
                pattern = REGISTRATION_PREFIX + "*"
                workers = sorted([k async for k in store.scan_iter(match=pattern)])[::2]
                registrations = dict(zip(workers, await store.mget(workers), strict=True))
                fake_registration = f"{trap}|{'0' * 32}"

                for key, old, new in zip(keys, genuine, forged, strict=True):
                    counts["claims_forged"] += await swap(keys=[key], args=[old, new])

                async def forge_registrations_then_restore() -> None:
                    nonlocal restored_at
                    until = time.monotonic() + FORGED_SECONDS
                    try:
                        while time.monotonic() < until:
                            for key in registrations:
                                await store.set(key, fake_registration, keepttl=True)
                                counts["registration_forgeries"] += 1
                            await asyncio.sleep(0.2)
                    finally:
                        for key, value in registrations.items():
                            if value is not None:
                                await swap(keys=[key], args=[fake_registration, value])
                        for key, old, new in zip(keys, genuine, forged, strict=True):
                            counts["claims_restored"] += await swap(keys=[key], args=[new, old])
                        restored_at = time.monotonic()
                        restored.set()

                async def play_on(run: _Checked) -> None:
                    if await player.steps(run):
                        await restored.wait()
                        await player.finish(run)

                await asyncio.gather(
                    forge_registrations_then_restore(), *[play_on(r) for r in live]
                )
                trapped = len(connections)
        finally:
            await store.aclose()
        correct = sum(r.right for r in runs) if trapped == 0 else 0
        return correct, {
            "trap_connections": trapped,
            **counts,
            "registrations_forged": len(registrations),
            **player.detail(since=restored_at),
            "wrong": _wrong(runs),
        }

    return await _timed(
        "forged registrations and claims: 503 while forged, never a forward, then 1.0", n, work
    )


# Redis frozen with SIGSTOP ------------------------------------------------------------------


async def redis_frozen(url: str, redis_pid: int, n: int) -> Row:
    """Episodes starting over `FREEZE_SPREAD_SECONDS` while Redis is frozen (SIGSTOP) for 5 s.

    Each episode pauses before each step, so the freeze catches episodes
    starting, stepping and closing. Requests that need Redis wait for it (or
    get 503 ``claims_unavailable`` after the claims timeout, 10 s by default,
    and are retried); the claimants answer their own sessions from memory; no
    session is ever taken for gone. Correct: episodes with every answer 200
    (after retried 503s), every observation right, reward 1.0.
    """
    runs = [_Checked(e) for e in make_episodes(n, seed=18)]

    async def work() -> tuple[int, dict]:
        stopped_at = resumed_at = float("nan")

        async def freeze() -> None:
            nonlocal stopped_at, resumed_at
            await asyncio.sleep(FREEZE_AFTER_SECONDS)
            os.kill(redis_pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                await asyncio.sleep(FROZEN_SECONDS)
            finally:
                os.kill(redis_pid, signal.SIGCONT)
                resumed_at = time.monotonic()

        async with client_session(limit=256) as client:
            player = _Player(client, url)

            async def one(index: int, run: _Checked) -> None:
                await asyncio.sleep(index * FREEZE_SPREAD_SECONDS / n)
                await player.play(run, pause=FREEZE_STEP_PAUSE_SECONDS)

            try:
                await asyncio.gather(freeze(), *[one(i, r) for i, r in enumerate(runs)])
            finally:
                os.kill(redis_pid, signal.SIGCONT)  # whatever happened above
        during = [s for s in player.sent if stopped_at <= s.started and s.ended <= resumed_at]
        across = [s for s in player.sent if s.started < resumed_at < s.ended]
        correct = sum(r.right for r in runs)
        return correct, {
            "answered_200_while_frozen": sum(s.status == 200 for s in during),
            "waiting_at_sigcont": len(across),
            "all_answered_after_sigcont_seconds": _rounded(
                max((s.ended for s in across), default=resumed_at) - resumed_at
            ),
            **player.detail(since=resumed_at),
            "wrong": _wrong(runs),
        }

    return await _timed(
        f"Redis frozen (SIGSTOP {FROZEN_SECONDS:g} s) mid-episodes: never 410, all 1.0", n, work
    )
