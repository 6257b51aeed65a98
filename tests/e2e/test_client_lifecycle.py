"""Clients leak nothing: sessions close at garbage collection and exit, reset after close, headers.

Against real multi-worker servers (one per kind for the module; the test that
freezes its workers has its own): an env collected without ``close()``, a
process that exits (or is interrupted) with envs open, and a process whose
server stops answering all leave no live session on any worker and no
"Unclosed client session" or "Exception ignored" on stderr. ``reset()`` after
``close()`` starts a new session, so both env checkers (gymnasium's, and
Stable-Baselines3's when it is installed) pass with their render checks.
``headers=`` reach every request of every client through an authenticating
proxy that refuses requests without them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import gymnasium as gym
import numpy as np
import pytest
from aiohttp import web
from gymnasium.utils.env_checker import check_env

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv, RemoteEnv, RemoteVectorEnv, run_episodes
from gym_sessions.errors import HTTPError
from gym_sessions.server.process import ServerProcess
from tests.conftest import import_extra_or_skip

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"
COUNTER = "envs.counter:CounterEnv"
AUTH = {"X-Proxy-Auth": "s3cret"}
HEADLESS = {"SDL_VIDEODRIVER": "dummy"}  # CartPole's renderer never needs a display
# What a process that leaks something prints at exit.
LEAK_MARKERS = ("Unclosed", "Exception ignored", "Task was destroyed", "never awaited")


# Live sessions on every worker --------------------------------------------------------------------


def live_sessions(server: ServerProcess, workers: int, within: float = 15.0) -> int:
    """Sessions open on the server: ``/health`` of every worker, each asked on a new connection.

    One connection after another tends to reach the same worker, so probes go
    out 16 at a time until every worker has answered (bounded by ``within``).
    """
    seen: dict[str, int] = {}
    deadline = time.monotonic() + within
    with ThreadPoolExecutor(8) as pool:
        while len(seen) < workers:
            if time.monotonic() > deadline:
                raise AssertionError(f"only workers {sorted(seen)} answered /health")
            for health in pool.map(lambda _: server.health(), range(16)):
                seen[health["worker"]] = health["sessions"]
    return sum(seen.values())


def settled_sessions(
    server: ServerProcess, workers: int, expected: int, within: float = 5.0
) -> int:
    """Live sessions once they equal ``expected``, or after ``within`` seconds."""
    deadline = time.monotonic() + within
    while (count := live_sessions(server, workers)) != expected and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


# Child processes ----------------------------------------------------------------------------------

# Each child script opens envs on sys.argv[1], prints "ready" with how many
# sessions it holds, then waits for a line on stdin (or for SIGINT).
OPENS_AND_EXITS = r"""
import asyncio, sys
import gymnasium, gym_sessions
from gym_sessions.client import AsyncRemoteEnv, RemoteEnv

url = sys.argv[1]
remote = RemoteEnv(url)
remote.reset(options={"initial_count": 1})
remote.step(1)
made = gymnasium.make("gym_sessions/Remote-v0", url=url)
made.reset()
vector = gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=3, url=url)
vector.reset()
vector.step(vector.action_space.sample())


async def open_async():
    kept = await AsyncRemoteEnv.create(url)  # outlives its event loop
    await kept.reset()
    fresh = await AsyncRemoteEnv.create(url, keep_alive=False)
    await fresh.reset()
    await fresh.step(2)
    dropped = await AsyncRemoteEnv.create(url)  # collected inside the running loop
    await dropped.reset()
    return kept, fresh


kept = asyncio.run(open_async())
idle_loop = asyncio.new_event_loop()  # never run again, never closed
idle = idle_loop.run_until_complete(AsyncRemoteEnv.create(url))
idle_loop.run_until_complete(idle.reset())
print("ready", 1 + 1 + 3 + 2 + 1, flush=True)
sys.stdin.readline()
"""

STEPS_UNTIL_INTERRUPTED = {
    "sync": r"""
import sys, gym_sessions
from gym_sessions.client import RemoteEnv

env = RemoteEnv(sys.argv[1])
env.reset()
print("ready", 1, flush=True)
while True:
    env.step(1)
""",
    "vector": r"""
import sys, gymnasium, gym_sessions

envs = gymnasium.make_vec("gym_sessions/Remote-v0", num_envs=3, url=sys.argv[1])
envs.reset()
print("ready", 3, flush=True)
while True:
    envs.step(envs.action_space.sample())
""",
    "async": r"""
import asyncio, sys, gym_sessions
from gym_sessions.client import AsyncRemoteEnv


async def main():
    env = await AsyncRemoteEnv.create(sys.argv[1])
    await env.reset()
    print("ready", 1, flush=True)
    while True:
        await env.step(1)


asyncio.run(main())
""",
}


class Child:
    """A child Python process running ``script`` against ``url``; killed if still running."""

    def __init__(self, script: str, url: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", script, url],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def wait_ready(self, within: float = 60.0) -> int:
        """Wait for the child's "ready N" line; returns N, the sessions it holds."""
        readable, _, _ = select.select([self.process.stdout], [], [], within)
        line = self.process.stdout.readline() if readable else ""
        if not line.startswith("ready"):
            self.kill()
            raise AssertionError(f"child not ready: {line!r}\n{self.process.stderr.read()}")
        return int(line.split()[1])

    def finish(self, within: float = 60.0, stdin: str | None = None) -> tuple[int, str]:
        """Let the child end (after ``stdin``, if given); returns its exit code and stderr."""
        try:
            _, stderr = self.process.communicate(stdin, timeout=within)
        except subprocess.TimeoutExpired as timeout:
            self.process.kill()
            _, stderr = self.process.communicate(timeout=10)
            message = f"the child did not end within {within} s; its stderr:\n{stderr}"
            raise AssertionError(message) from timeout
        finally:
            self.kill()
        return self.process.returncode, stderr

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate(timeout=10)


@pytest.fixture
def children() -> Iterator[Callable[[str, str], Child]]:
    started: list[Child] = []

    def start(script: str, url: str) -> Child:
        started.append(Child(script, url))
        return started[-1]

    yield start
    for child in started:
        child.kill()


def assert_no_leak_printed(stderr: str) -> None:
    for marker in LEAK_MARKERS:
        assert marker not in stderr, stderr


# An authenticating reverse proxy ------------------------------------------------------------------

# Hop-by-hop headers and those aiohttp computes itself: never copied across.
_NOT_FORWARDED = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
}


class AuthProxy:
    """A reverse proxy on 127.0.0.1 in its own thread: 401 without ``AUTH``, else forwards.

    Records every request as ``"METHOD /path"`` in `forwarded` or `refused`.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.forwarded: list[str] = []
        self.refused: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    async def _start(self) -> str:
        self._client = aiohttp.ClientSession(
            auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def _forward(self, request: web.Request) -> web.Response:
        what = f"{request.method} {request.path}"
        name, secret = next(iter(AUTH.items()))
        if request.headers.get(name) != secret:
            self.refused.append(what)
            return web.Response(status=401, text="proxy authentication required")
        self.forwarded.append(what)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() not in _NOT_FORWARDED and k.lower() != name.lower()
        }
        async with self._client.request(
            request.method,
            self.upstream + request.path_qs,
            data=await request.read(),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=30),
        ) as reply:
            body = await reply.read()
            back = [(k, v) for k, v in reply.headers.items() if k.lower() not in _NOT_FORWARDED]
            response = web.Response(status=reply.status, body=body)
            for k, v in back:
                response.headers.add(k, v)
            return response

    def requests(self, what: str) -> int:
        return self.forwarded.count(what)

    def close(self) -> None:
        async def stop() -> None:
            await self._runner.cleanup()
            await self._client.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop.close()


@pytest.fixture
def auth_proxy() -> Iterator[Callable[[str], AuthProxy]]:
    made: list[AuthProxy] = []

    def make(upstream: str) -> AuthProxy:
        made.append(AuthProxy(upstream))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


# Garbage collection and exit ----------------------------------------------------------------------


def _open_and_drop_sync(url: str) -> str:
    env = gym.make(REMOTE, url=url)
    env.reset(options={"initial_count": 3})
    env.step(1)
    return env.unwrapped.session_id


def _open_and_drop_async(url: str) -> str:
    async def main() -> str:
        env = await AsyncRemoteEnv.create(url)
        await env.reset()
        return env.session_id

    return asyncio.run(main())


def _open_and_drop_vector(url: str) -> str:
    envs = gym.make_vec(REMOTE, num_envs=3, url=url)
    envs.reset()
    envs.step(envs.action_space.sample())
    return ",".join(envs.unwrapped.session_ids)


@pytest.mark.parametrize(
    "open_and_drop",
    [_open_and_drop_sync, _open_and_drop_async, _open_and_drop_vector],
    ids=["sync", "async", "vector"],
)
def test_an_env_collected_without_close_closes_its_sessions(module_serve, open_and_drop):
    server = module_serve(COUNTER, workers=4)
    threads = threading.active_count()
    gc.collect()  # garbage of earlier tests warns on collection too: not this env's doing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert open_and_drop(server.url)  # the env is unreachable once this returns
        gc.collect()
    assert settled_sessions(server, 4, 0) == 0
    assert threading.active_count() == threads  # a vector env's loop thread stopped too
    assert not [w for w in caught if "nclosed" in str(w.message)]


def test_a_process_that_exits_with_envs_open_closes_them_and_prints_nothing(module_serve, children):
    server = module_serve(COUNTER, workers=4)
    child = children(OPENS_AND_EXITS, server.url)
    held = child.wait_ready()
    # The AsyncRemoteEnv dropped inside its loop is already closed.
    assert live_sessions(server, 4) == held
    code, stderr = child.finish(stdin="\n")
    assert code == 0, stderr
    assert stderr.strip() == ""
    assert settled_sessions(server, 4, 0) == 0


@pytest.mark.parametrize("client", sorted(STEPS_UNTIL_INTERRUPTED))
def test_a_process_interrupted_mid_episode_closes_its_sessions(module_serve, children, client):
    server = module_serve(COUNTER, workers=4)
    child = children(STEPS_UNTIL_INTERRUPTED[client], server.url)
    held = child.wait_ready()
    assert live_sessions(server, 4) == held
    time.sleep(0.3)  # stepping
    child.process.send_signal(signal.SIGINT)
    code, stderr = child.finish()
    assert code != 0
    assert stderr.rstrip().endswith("KeyboardInterrupt"), stderr
    assert_no_leak_printed(stderr)
    assert settled_sessions(server, 4, 0) == 0


def test_exit_is_bounded_and_quiet_when_the_server_stops_answering(serve, children):
    server = serve(COUNTER, workers=2)
    child = children(OPENS_AND_EXITS, server.url)
    child.wait_ready()
    frozen = [server.process.pid, *server.worker_pids()]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)  # connections are still accepted, never answered
    try:
        started = time.monotonic()
        code, stderr = child.finish(within=30, stdin="\n")
        elapsed = time.monotonic() - started
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    assert code == 0, stderr
    assert stderr.strip() == ""
    # 5 single envs (about 1 s each: the reply timeout) and one vector env (2 s for all 3).
    assert elapsed < 5 * 2 + 2 + 3, elapsed


# reset() after close() ----------------------------------------------------------------------------


def test_remote_env_reset_after_close_starts_a_new_session(module_serve):
    server = module_serve(COUNTER, workers=2)
    env = RemoteEnv(server.url)
    env.reset(options={"initial_count": 5})
    first = env.session_id
    env.close()
    observation, _ = env.reset(options={"initial_count": 7, "expected_count": 9})
    assert observation == 7 and env.session_id != first
    assert env.step(2)[0] == 9 and env.verify()["reward"] == 1.0
    assert env.worker
    assert live_sessions(server, 2) == 1
    env.close()
    env.close()
    assert live_sessions(server, 2) == 0


def test_async_env_reset_after_close_starts_a_new_session(module_serve):
    server = module_serve(COUNTER, workers=2)

    async def main() -> tuple[str, str, int]:
        async with AsyncRemoteEnv(server.url) as env:
            await env.reset(options={"initial_count": 5})
            first = env.session_id
            await env.close()
            await env.reset(options={"initial_count": 7})
            return first, env.session_id, int((await env.step(2))[0])

    first, second, count = asyncio.run(main())
    assert first != second and count == 9
    assert live_sessions(server, 2) == 0


def test_render_close_then_reset_and_steps_as_sb3_check_env_does(module_serve, monkeypatch):
    for name, value in HEADLESS.items():
        monkeypatch.setenv(name, value)
    server = module_serve("CartPole-v1", workers=2)
    env = gym.make(REMOTE, url=server.url, render_mode="rgb_array")
    env.reset(seed=0)
    assert env.render().shape == (400, 600, 3)
    env.close()  # SB3's render check ends with close(), then its NaN check resets and steps
    env.reset()
    for _ in range(20):
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        if terminated or truncated:
            env.reset()
    env.close()
    assert live_sessions(server, 2) == 0


def test_gymnasium_check_env_with_render_check_passes_after_close(module_serve, monkeypatch):
    for name, value in HEADLESS.items():
        monkeypatch.setenv(name, value)
    server = module_serve("CartPole-v1", workers=2)
    env = gym.make(REMOTE, url=server.url, render_mode="rgb_array")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(env.unwrapped)
        first = env.unwrapped.session_id
        env.close()
        check_env(env.unwrapped)
    assert env.unwrapped.session_id != first
    about = [str(w.message) for w in caught if "render" in str(w.message).lower()]
    about += [str(w.message) for w in caught if "close" in str(w.message).lower()]
    assert about == []
    env.close()
    assert live_sessions(server, 2) == 0


def test_stable_baselines3_check_env_with_render_check(module_serve, monkeypatch):
    # The sb3 extra (make venv installs it): skipped without it, failed on CI.
    env_checker = import_extra_or_skip("stable_baselines3.common.env_checker", "sb3")
    sb3_check_env = env_checker.check_env
    for name, value in HEADLESS.items():
        monkeypatch.setenv(name, value)
    server = module_serve("CartPole-v1", workers=2)
    env = gym.make(REMOTE, url=server.url, render_mode="rgb_array")
    sb3_check_env(env.unwrapped, warn=True, skip_render_check=False)
    env.close()
    assert live_sessions(server, 2) == 0


# keep_alive=False ---------------------------------------------------------------------------------


def test_async_env_without_keep_alive_completes_an_episode(module_serve):
    server = module_serve(COUNTER, workers=4)

    async def main() -> float:
        async with AsyncRemoteEnv(server.url, keep_alive=False) as env:
            await env.reset(options={"initial_count": 2, "expected_count": 0})
            for increment in (3, -4, -1):
                await env.step(increment)
            return (await env.verify())["reward"]

    assert asyncio.run(main()) == 1.0
    assert live_sessions(server, 4) == 0


# headers= -----------------------------------------------------------------------------------------


async def _async_episode(url: str) -> float:
    async with AsyncRemoteEnv(url, headers=AUTH) as env:
        await env.reset(options={"initial_count": 1, "expected_count": 4})
        await env.step(3)
        return (await env.verify())["reward"]


def test_headers_go_on_every_request_of_every_client(module_serve, auth_proxy):
    server = module_serve(COUNTER, workers=2)
    proxy = auth_proxy(server.url)
    with pytest.raises(HTTPError) as refused:
        RemoteEnv(proxy.url)
    assert refused.value.status == 401 and proxy.refused == ["GET /spaces"]
    proxy.refused.clear()

    env = gym.make(REMOTE, url=proxy.url, headers=AUTH)
    env.reset(options={"initial_count": 1, "expected_count": 3})
    env.step(2)
    assert env.unwrapped.verify()["reward"] == 1.0
    env.close()
    assert asyncio.run(_async_episode(proxy.url)) == 1.0
    envs = gym.make_vec(REMOTE, num_envs=3, url=proxy.url, headers=AUTH)
    envs.reset(options={"initial_count": 0})
    _, _, _, _, _ = envs.step(np.array([1, 2, 3]))
    envs.close()
    records = run_episodes(
        proxy.url,
        lambda observation: 1,
        episodes=3,
        num_envs=2,
        max_episode_steps=2,
        headers=AUTH,
        progress=False,
    )
    assert len({r["episode"] for r in records}) == 3

    assert proxy.refused == []
    for route in ("/spaces", "/reset", "/health", "/step", "/verify", "/close_session"):
        assert any(seen.endswith(" " + route) for seen in proxy.forwarded), route
    # 1 + 1 + 3 + 2 sessions, each closed once.
    assert proxy.requests("POST /close_session") == 7
    assert live_sessions(server, 2) == 0


def test_headers_reach_the_close_at_garbage_collection_and_no_session_closes_twice(
    module_serve, auth_proxy
):
    server = module_serve(COUNTER, workers=2)
    proxy = auth_proxy(server.url)
    closed = RemoteEnv(proxy.url, headers=AUTH)
    closed.reset()
    closed.close()
    dropped = RemoteEnv(proxy.url, headers=AUTH)
    dropped.reset()
    envs = RemoteVectorEnv(2, proxy.url, headers=AUTH)
    envs.reset()
    assert live_sessions(server, 2) == 3
    del closed, dropped, envs
    gc.collect()
    assert proxy.refused == []
    assert proxy.requests("POST /close_session") == 4  # one each: none twice
    assert live_sessions(server, 2) == 0


def test_headers_the_client_sets_itself_are_refused(module_serve):
    server = module_serve(COUNTER)
    for name in ("Content-Type", "connection", "Host"):
        with pytest.raises(ValueError, match=name):
            RemoteEnv(server.url, headers={name: "x"})
    with pytest.raises(ValueError, match="line break"):
        RemoteEnv(server.url, headers={"X-Proxy-Auth": "s3cret\r\nX-Injected: 1"})
    envs = gym.make_vec(REMOTE, num_envs=1, url=server.url)
    try:
        with pytest.raises(ValueError, match="headers= goes with a URL"):
            run_episodes(envs, lambda observation: 1, episodes=1, headers=AUTH, progress=False)
    finally:
        envs.close()
