"""In-process workers sharing one real runtime directory, for routing unit tests.

Each worker is a real `WorkerApp` with its real private Unix socket; tests reach
a chosen worker through a public Unix listener of its own, so they decide which
worker accepts each request (as uvicorn's shared socket would, at random).

A cluster started with a `FakeClock` measures claim windows on it: a test lets a
window pass with `Cluster.elapse` (the clock moves, then every worker sweeps)
instead of sleeping through it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aiohttp
import redis

from gym_sessions.credentials import SessionCredentials
from gym_sessions.routing.claim_store import FileClaimStore
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.runtime_dir import RuntimeDirectory
from gym_sessions.server.app import WorkerApp
from gym_sessions.server.backends import RedisBackend
from gym_sessions.server.closed_sessions import ClosedResourcesSessionRecords
from gym_sessions.server.resources import ResourcesServer
from gym_sessions.settings import Settings
from gym_sessions.transport.private_listener import PrivateListener

from .fake_clock import FakeClock

SECRET = "test-secret-" + "x" * 20
#: The close-retry window of the shared ``cluster`` fixture's workers (seconds).
CLOSE_RETRY_WINDOW = 0.5


async def wait_until(predicate: Any, within: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds or ``within`` seconds pass (bounded)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


def holder_of(claim_value: str | None) -> str | None:
    """The worker id in a Redis claim value (``<worker id>|<address>|<MAC>``)."""
    return None if claim_value is None else claim_value.split("|", 1)[0]


def new_id() -> str:
    return uuid.uuid4().hex


async def seed_start(worker: Worker, sid: str | None = None) -> Reply:
    """Start a probe-server session at ``worker`` (a new id unless given); its reply."""
    return await worker.request("POST", "/seed_session", {"resources_session_id": sid or new_id()})


def dead_worker_id() -> str:
    """A worker id whose pid is a process that has exited (a real one, reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return f"{child.pid}-{os.urandom(4).hex()}"


def redis_backend(worker: Worker) -> RedisBackend:
    """The Redis backend of a worker of a cluster with Redis claims."""
    backend = worker.app.backend
    assert isinstance(backend, RedisBackend), backend
    return backend


def stand_in_process() -> subprocess.Popen:
    """A real process for an in-process worker's id to name: alive until the worker is killed.

    Liveness checks read ``/proc`` for the pid in a worker's id, so a worker
    whose id names this process is alive to them, and gone once `Worker.kill`
    kills it. It also exits on its own if the test process dies (its stdin closes).
    """
    return subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )


def honest_key(session_id: str) -> str:
    """The ``session_key`` the test client sends for ``session_id`` (one per id)."""
    return hashlib.sha256(b"honest-key:" + session_id.encode()).hexdigest()


def with_honest_key(body: Any) -> Any:
    """``body`` with the honest key of the id it names, unless it brings a key of its own.

    Real clients send a random key per session with every typed start and close;
    tests of routing do the same, so they reach their sessions without cookies.
    Tests of ownership pass ``session_key`` themselves (``None`` to send none).
    """
    if not isinstance(body, dict) or "session_key" in body:
        if isinstance(body, dict) and body.get("session_key", "") is None:
            return {k: v for k, v in body.items() if k != "session_key"}
        return body
    sid = body.get("resources_session_id", body.get("agent_session_id"))
    return {**body, "session_key": honest_key(sid)} if isinstance(sid, str) else body


def count_call(request_id: int) -> dict[str, Any]:
    """A JSON-RPC ``tools/call`` of the probe server's ``count`` tool."""
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": "count", "arguments": {}},
    }


@dataclass
class Reply:
    status: int
    json: Any
    cookie: str | None
    set_cookies: list[str]
    headers: Any


class Worker:
    """One in-process worker and a client that always reaches it."""

    def __init__(
        self, app: WorkerApp, public_path: str, stand_in: subprocess.Popen | None = None
    ) -> None:
        self.app = app
        self.public_path = public_path
        #: The real process the worker's id names (`stand_in_process`), if any.
        self.stand_in = stand_in
        self.listener = PrivateListener(app, public_path, private=False)
        self.client: aiohttp.ClientSession | None = None

    @property
    def id(self) -> str:
        return self.app.worker_id

    @property
    def server(self) -> Any:
        return self.app.server

    async def start(self) -> None:
        await self.app.startup()
        await self.listener.start()
        # The test's public listener serves connections handed to this worker,
        # as a worker's uvicorn server does (`DrainableServer`).
        self.app.serve_handed_connections(self.listener.new_protocol, lambda: True)
        self.client = _client(self.public_path)

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.close()
        await self.listener.stop()
        await self.app.shutdown()
        self._end_stand_in()

    async def kill(self) -> None:
        """Stop answering at once, as a SIGKILLed worker does: no shutdown, no release.

        Its listeners go (its private socket refuses) and its background work
        stops; its memory stays, unreachable, as a dead process's would.
        Other workers can tell it exited if its id names a process: its
        stand-in process (killed and reaped here) or one that has already
        exited (`dead_worker_id`).
        """
        for task in self.app._background:
            task.cancel()
        await self.stop_listening()
        self._end_stand_in()

    def _end_stand_in(self) -> None:
        if self.stand_in is not None and self.stand_in.returncode is None:
            self.stand_in.kill()
            self.stand_in.wait()

    async def stop_listening(self) -> None:
        """Close every socket this worker listens on: public, private and handoff."""
        await self.listener.stop()
        assert self.app._listener is not None
        await self.app._listener.stop()
        if self.app.handoff_listener is not None:
            await self.app.handoff_listener.stop()

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        cookie: str | None = None,
        headers: dict[str, str] | None = None,
        raw: bytes | None = None,
    ) -> Reply:
        assert self.client is not None
        return await send(self.client, method, path, body, cookie=cookie, headers=headers, raw=raw)


def _client(path: str) -> aiohttp.ClientSession:
    # force_close: every request on a new connection, as in the e2e tests. Each
    # asks for keep-alive all the same (aiohttp would say "Connection: close"),
    # so a worker may hand the connection to the session's holder (handoff).
    return aiohttp.ClientSession(
        connector=aiohttp.UnixConnector(path=path, force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        headers={"Connection": "keep-alive"},
    )


async def send(
    client: aiohttp.ClientSession,
    method: str,
    path: str,
    body: Any = None,
    *,
    cookie: str | None = None,
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
    cookie_name: str = "gym_session",
) -> Reply:
    send_headers = dict(headers or {})
    if cookie:
        send_headers["Cookie"] = f"{cookie_name}={cookie}"
    kwargs: dict[str, Any] = {"headers": send_headers}
    if raw is not None:
        kwargs["data"] = raw
    elif body is not None:
        kwargs["json"] = with_honest_key(body)
    async with client.request(method, "http://worker" + path, **kwargs) as response:
        data = await response.read()
        set_cookies = response.headers.getall("set-cookie", [])
        new_cookie = None
        for value in set_cookies:
            name, _, rest = value.partition("=")
            if name == cookie_name:
                new_cookie = rest.split(";", 1)[0]
        try:
            parsed = await response.json(content_type=None) if data else None
        except ValueError:
            parsed = data
        return Reply(response.status, parsed, new_cookie or cookie, set_cookies, response.headers)


class Cluster:
    """``n`` in-process workers of one server sharing a runtime directory."""

    def __init__(
        self,
        workers: list[Worker],
        runtime_dir: RuntimeDirectory | None,
        settings,
        clock: FakeClock | None = None,
    ):
        self.workers = workers
        self.runtime_dir = runtime_dir
        self.settings = settings
        self.clock = clock
        self.credentials = SessionCredentials(settings.secret, settings.session_cookie)
        self._redis: redis.Redis | None = None

    def __getitem__(self, index: int) -> Worker:
        return self.workers[index]

    def claim_owner(self, session_id: str) -> str | None:
        if self.settings.redis_claims:
            return holder_of(self.redis().get(RedisClaimStore.key(session_id)))
        assert self.runtime_dir is not None
        return FileClaimStore(self.runtime_dir.claims_dir, "reader").read_now(session_id)

    def redis(self) -> redis.Redis:
        """A blocking Redis client on the cluster's claim store (Redis claims only)."""
        if self._redis is None:
            self._redis = redis.Redis.from_url(self.settings.claims, decode_responses=True)
        return self._redis

    def claim_count(self) -> int:
        return 0 if self.runtime_dir is None else self.runtime_dir.claim_count()

    def live_sessions(self) -> list[int]:
        """Each worker's live sessions, in worker order."""
        return [w.app.claims.live_sessions for w in self.workers]

    def private_client(self, worker: Worker) -> aiohttp.ClientSession:
        assert self.runtime_dir is not None
        return _client(self.runtime_dir.socket_path(worker.id))

    def cookie_for(self, session_id: str) -> str:
        return self.credentials.encode_cookie({"session_id": session_id})

    async def elapse(self, seconds: float) -> None:
        """Let ``seconds`` pass on the workers' clock, then sweep as their background would.

        Returns once every claim the sweeps ended is out of the store too.
        """
        assert self.clock is not None, "start the cluster with clock=FakeClock()"
        self.clock.advance(seconds)
        for worker in self.workers:
            worker.app.claims.sweep()
        for worker in self.workers:
            await worker.app.claims.wait_for_store()

    async def stop(self) -> None:
        for worker in self.workers:
            await worker.stop()
        if self._redis is not None:
            self._redis.close()


def _use_clock(app: WorkerApp, clock: FakeClock) -> None:
    """Measure ``app``'s claim windows (and a resources server's close records) on ``clock``.

    `OwnedClaims` takes a clock, but `WorkerApp` builds it with the real one and
    has no parameter to pass another: set it before the worker starts.
    """
    app.claims._clock = clock
    if isinstance(app.server, ResourcesServer):
        # Close records must not outlive the claim (they run on the same window).
        window = app.settings.session_close_retry_window_seconds
        app.server.closed = ClosedResourcesSessionRecords(window, clock)


async def start_cluster(
    make_server: Any,
    n: int,
    base: str,
    *,
    routed: bool = True,
    clock: FakeClock | None = None,
    worker_ids: list[str] | None = None,
    stand_ins: bool = False,
    **settings_kw: Any,
) -> Cluster:
    """Start ``n`` workers, each serving a fresh ``make_server()``, on ``clock`` if given.

    ``worker_ids``: the workers' ids (default: ids naming no process, so no
    worker is ever known to have exited). ``stand_ins``: each id names a
    `stand_in_process` instead, which `Worker.kill` ends.
    """
    # In-process workers stop together at teardown, when nobody is left to
    # forward to them: waiting for forwarded requests to go quiet (half a
    # second each time) protects nothing here. tests/e2e/test_operations.py
    # covers that wait with real processes.
    settings_kw.setdefault("graceful_timeout", 0.0)
    # Every test request is on a new connection: let the first be handed over,
    # so that routing tests exercise the handoff wherever they would hop.
    handoff_from_request = settings_kw.pop("handoff_from_request", 1)
    # These tests choose which worker accepts each request and expect a start
    # to open its session there; tests of balanced placement ask for it.
    settings_kw.setdefault("placement", "local")
    settings = Settings(workers=n, secret=SECRET, routes_sessions_to_holder=routed, **settings_kw)
    runtime_dir = None
    if settings.routed and not settings.redis_claims:
        runtime_dir = RuntimeDirectory.create(base)
        settings = settings.replace(runtime_dir=runtime_dir.path)
    workers = []
    for index in range(n):
        server: ResourcesServer = make_server()
        stand_in = stand_in_process() if stand_ins else None
        if stand_in is not None:
            worker_id = f"{stand_in.pid}-{os.urandom(4).hex()}"
        elif worker_ids:
            worker_id = worker_ids[index]
        else:
            worker_id = f"w{index}-{os.urandom(3).hex()}"
        app = WorkerApp(server, settings, worker_id=worker_id)
        if app.handoff is not None:
            app.handoff.from_request = handoff_from_request
        if clock is not None:
            _use_clock(app, clock)
        public_path = os.path.join(base, f"public-{index}-{os.urandom(3).hex()}.sock")
        worker = Worker(app, public_path, stand_in)
        await worker.start()
        workers.append(worker)
    return Cluster(workers, runtime_dir, settings, clock)
