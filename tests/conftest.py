"""Shared fixtures: real server processes on free loopback ports, stopped by PID."""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import uvicorn

from gym_sessions.server.process import ServerProcess, start_server
from gym_sessions.transport.http_protocol import BoundedHttpProtocol, uvicorn_tested
from tests.services import RedisDatabase, RedisProcess, require


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--open-uvicorn-gate",
        action="store_true",
        help="in this process, hand connections over and coalesce replies on an untested "
        "uvicorn too (make uvicorn-latest: do the internals still work there?)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """The uvicorn gate (``--open-uvicorn-gate``), and a working Ctrl-C for children.

    A shell without job control starts background commands with SIGINT ignored,
    and an ignored signal stays ignored through fork and exec: every client and
    server the tests start would then ignore the SIGINT the tests send. A
    handler (unlike an ignore) is reset to the default in the child.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if config.getoption("--open-uvicorn-gate"):
        BoundedHttpProtocol.handoff_enabled = True
        BoundedHttpProtocol.coalesces_replies = True


def needs_handoff(*, in_process: bool = True) -> pytest.MarkDecorator:
    """Skip a test that needs connection handoff where the uvicorn gate turned it off.

    Call it at a test module's import (after ``--open-uvicorn-gate`` took effect);
    ``in_process=False`` for tests of server processes, which the option never opens.
    """
    enabled = BoundedHttpProtocol.handoff_enabled if in_process else uvicorn_tested()
    return pytest.mark.skipif(
        not enabled,
        reason=f"uvicorn {uvicorn.__version__} is not in TESTED_UVICORN: handoff is off "
        "(tests/test_uvicorn_gate.py checks the hop that replaces it)",
    )


def require_or_skip(program: str, package: str) -> None:
    """Skip a test whose outside program is missing; on CI (``CI=true``) fail instead."""
    try:
        require(program, package)
    except FileNotFoundError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(exc))


def import_extra_or_skip(module: str, extra: str) -> ModuleType:
    """Import ``module`` of an optional extra, or skip the test module (fail on CI) with the hint.

    Call it at module level, before importing anything that needs the extra.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if os.environ.get("CI"):
            raise
        hint = f"{module} is missing: pip install -e '.[dev,{extra}]' (or make venv)"
        pytest.skip(f"{hint} ({exc})", allow_module_level=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``) a module's tests run on one worker, so
    a module-scoped server starts once; a module may join a wider ``xdist_group``."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            module = getattr(item, "module", None)
            name = module.__name__ if module is not None else item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(name))


@pytest.fixture
def private_redis_server() -> Iterator[RedisProcess]:
    """A fresh, empty ``redis-server`` on a free loopback port, for a test that stops,
    freezes or reconfigures it; stopped at teardown."""
    require_or_skip("redis-server", "redis-server")
    server = RedisProcess()
    try:
        yield server.start()
    finally:
        server.close()


_SHARED_REDIS_DATABASES = 1024
_redis_databases = itertools.count()


@pytest.fixture(scope="session")
def shared_redis_server() -> Iterator[RedisProcess]:
    """One ``redis-server`` for the whole run (each xdist worker has its own)."""
    require_or_skip("redis-server", "redis-server")
    server = RedisProcess(databases=_SHARED_REDIS_DATABASES)
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def redis_server(shared_redis_server) -> RedisDatabase:
    """An empty database of the shared ``redis-server``: for tests that leave Redis running."""
    return RedisDatabase(shared_redis_server, next(_redis_databases) % _SHARED_REDIS_DATABASES)


@pytest.fixture
def short_tmp() -> Iterator[str]:
    """A temporary directory with a short path: Unix socket paths are limited to 107 bytes."""
    path = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stop_servers(servers: Iterable[ServerProcess]) -> None:
    """Stop each server; fail if one still running did not exit on SIGTERM (stop() killed it).

    A graceful stop that hangs is a bug of the server's shutdown (a worker that
    lost its SIGTERM, say), which the SIGKILL after 15 s would otherwise hide.
    """
    hung = []
    for server in servers:
        running = server.process.poll() is None
        pid = server.process.pid
        if server.stop() == -signal.SIGKILL and running:
            try:
                log = server.log()[-3000:]
            except OSError:  # its own temporary directory, removed by stop()
                log = "(log removed)"
            hung.append(f"supervisor {pid}:\n{log}")
    if hung:
        pytest.fail("SIGTERM did not stop the server within 15 s:\n" + "\n".join(hung))


@pytest.fixture
def serve(short_tmp) -> Iterator[Callable[..., ServerProcess]]:
    """Start servers with ``serve(target, *args, workers=N)``; all are stopped at teardown."""
    started: list[ServerProcess] = []

    def _serve(target: str, *args: str, workers: int = 1) -> ServerProcess:
        tmpdir = os.path.join(short_tmp, f"s{len(started)}")
        server = start_server(target, *args, workers=workers, tmpdir=tmpdir)
        started.append(server)
        return server

    yield _serve
    stop_servers(started)


class _ServerPool:
    """Servers kept running between tests, one per argument list, started on first use."""

    def __init__(self) -> None:
        self._started: dict[tuple[Any, ...], ServerProcess] = {}

    def serve(self, target: str, *args: str, workers: int = 1) -> ServerProcess:
        key = (target, args, workers)
        server = self._started.get(key)
        if server is None or server.process.poll() is not None:
            server = start_server(target, *args, workers=workers)
            self._started[key] = server
        return server

    def stop(self) -> None:
        stop_servers(self._started.values())


@pytest.fixture(scope="session")
def _run_servers() -> Iterator[_ServerPool]:
    pool = _ServerPool()
    yield pool
    pool.stop()


@pytest.fixture
def shared_serve(_run_servers) -> Callable[..., ServerProcess]:
    """``shared_serve(target, *args, workers=N)``: one server per argument list for the run.

    Started on first use and stopped when the run ends (per xdist worker), so
    only for tests that use sessions of their own: a test that stops, signals
    or kills the server or its workers, changes its files, or counts sessions,
    claims or metrics server-wide starts its own with `serve` (or, for
    counting, shares one with its module's tests through `module_serve`).
    """
    return _run_servers.serve


@pytest.fixture(scope="module")
def module_serve() -> Iterator[Callable[..., ServerProcess]]:
    """``module_serve(target, *args, workers=N)``: one server per argument list for a module.

    A module's tests run one after another on one xdist worker (``--dist
    loadgroup``, a group per module), so its tests may count sessions
    server-wide as long as each one closes every session it opened and
    asserts so. A test that stops, signals or kills the server or its
    workers starts its own with `serve`.
    """
    pool = _ServerPool()
    yield pool.serve
    pool.stop()


@pytest.fixture
async def web() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request and no cookie jar: credentials go only where a test
    puts them, and requests land on any worker (as a NeMo environment server calls)."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=64),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=60),
    ) as session:
        yield session
