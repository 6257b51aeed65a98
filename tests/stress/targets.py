"""Servers with injected failures for the stress suite (never used by production code).

- `FaultyCounterServer`: the counter env whose reset fails with 500 when the
  options ask for it, behind a middleware that holds back (so the client drops
  it) or cuts the reply of a request carrying ``x-stress-fault: delay`` or
  ``cut``, after the app ran it; with ``slow-step`` the env's step blocks its
  worker for `SLOW_STEP_SECONDS`, as a long real step does.
- `TallyServer`: a resources server whose session start never reads the
  session (as an agent's own untyped seed) and whose tools create per-session
  state lazily; it counts how many session states each worker created, so a
  session split across workers shows up as extra creations.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from contextvars import ContextVar
from typing import Any

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from envs.counter import CounterEnv
from gym_sessions.server.bodies import BodySchema
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool

FAULT_HEADER = b"x-stress-fault"
#: Names the marker file a held-back reply creates (32 hex digits).
MARK_HEADER = b"x-stress-mark"
#: The directory for those marker files, shared by the servers and the client.
FAULT_DIR_ENV = "GYM_SESSIONS_STRESS_FAULT_DIR"
#: A held-back reply waits at most this long for its client to drop it.
HOLD_SECONDS = 30.0
#: A ``slow-step`` step blocks its worker's event loop this long: past the 10 s
#: lifetime of a worker's registration in Redis.
SLOW_STEP_SECONDS = 12.0
_MARK = re.compile(rb"[0-9a-f]{32}")
# The mark of the ``slow-step`` request being served, for the env's step to see.
_slow_step: ContextVar[bytes | None] = ContextVar("stress_slow_step", default=None)


class _InjectedFault(Exception):
    pass


def mark_path(fault_dir: str, mark: str) -> str:
    """The marker file of a held-back reply or a slow step."""
    return os.path.join(fault_dir, mark)


def _create_marker(mark: bytes) -> str | None:
    """Create the marker file named by ``mark``; its path, or ``None`` without a valid one."""
    fault_dir = os.environ.get(FAULT_DIR_ENV)
    if not fault_dir or not _MARK.fullmatch(mark):
        return None
    path = mark_path(fault_dir, mark.decode())
    with open(path, "x"):
        pass
    return path


async def _hold_until_dropped(headers: dict[bytes, bytes]) -> None:
    """Say that the app has run (the marker file), then wait until the client dropped the reply.

    The client removes the marker once it has closed the connection, so the
    reply never reaches it, however slow the machine; without a marker
    directory or a valid mark the reply is held for `HOLD_SECONDS` and the
    client, which never sees a marker, reports the check failed.
    """
    deadline = time.monotonic() + HOLD_SECONDS
    path = _create_marker(headers.get(MARK_HEADER, b""))
    if path is None:
        await asyncio.sleep(HOLD_SECONDS)
        return
    while time.monotonic() < deadline:
        if not os.path.exists(path):
            return  # the client has closed the connection
        await asyncio.sleep(0.02)


class FaultInjectionMiddleware:
    """Runs the request, then breaks its reply.

    ``x-stress-fault: delay`` holds the whole reply back until the client has
    dropped it: once the app has run, the middleware creates the marker file
    named by ``x-stress-mark`` in ``$GYM_SESSIONS_STRESS_FAULT_DIR``; the
    client, seeing it, closes the connection and removes the marker, and only
    then is the reply sent (into a closed connection). So the client never sees
    any of the reply, and its retry always comes after the app ran the
    request, whatever the load (a client timeout instead can fire before the
    server has even read the request, and the abandoned request then runs in
    the middle of the retried episode). ``cut`` sends the headers and half the
    body, then closes the connection. ``slow-step`` leaves the reply alone and
    makes the env's step slow (`FaultyCounterEnv.step`); it runs on the worker
    that holds the session, wherever the request came in.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", [])) if scope["type"] == "http" else {}
        fault = headers.get(FAULT_HEADER)
        if fault is None:
            await self.app(scope, receive, send)
            return
        if fault == b"slow-step":
            token = _slow_step.set(headers.get(MARK_HEADER, b""))
            try:
                await self.app(scope, receive, send)
            finally:
                _slow_step.reset(token)
            return

        async def faulty_send(message: Message) -> None:
            if fault == b"delay":
                if message["type"] == "http.response.start":
                    await _hold_until_dropped(headers)
                await send(message)
                return
            if message["type"] == "http.response.start":
                await send(message)
                return
            body = message.get("body", b"")
            await send(
                {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
            )
            # uvicorn closes a connection whose app raised after the reply started.
            raise _InjectedFault("cut")

        await self.app(scope, receive, faulty_send)


class FaultyCounterEnv(CounterEnv):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        if options and options.get("fail"):
            raise RuntimeError("injected reset failure")
        return super().reset(seed=seed, options=options)

    def step(self, action: Any):
        mark = _slow_step.get()
        if mark is not None:
            # The marker tells the client the step runs; then block the event loop
            # (no await), as a long step of a real env does.
            _create_marker(mark)
            time.sleep(SLOW_STEP_SECONDS)
        return super().step(action)


class FaultyCounterServer(GymEnvServer):
    def __init__(self) -> None:
        super().__init__(FaultyCounterEnv, "faulty-counter")

    def middleware(self) -> list[Middleware]:
        return [Middleware(FaultInjectionMiddleware)]


class TallyServer(ResourcesServer):
    """``/seed_session`` never reads the session; ``add`` and ``total`` create state lazily."""

    def __init__(self) -> None:
        self.tallies: dict[str, int] = {}
        self.created = 0

    def routes(self) -> list[BaseRoute]:
        # First, so it shadows the base start route (which reads the session).
        return [Route("/seed_session", self._blind_start, methods=["POST"]), *super().routes()]

    async def _blind_start(self, request: Request) -> JSONResponse:
        return JSONResponse({"started": True})

    def _tally(self, request: Request) -> tuple[str, int]:
        sid = session_id(request)
        if sid not in self.tallies:
            self.tallies[sid] = 0
            self.created += 1
        return sid, self.tallies[sid]

    def tools(self) -> list[Tool]:
        async def add(request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
            sid, value = self._tally(request)
            self.tallies[sid] = value + 1
            return {"total": value + 1}

        async def total(request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
            return {"total": self._tally(request)[1]}

        return [
            Tool("add", "Add one to this session's tally.", BodySchema(), add),
            Tool("total", "Read this session's tally.", BodySchema(), total),
        ]

    def release_session(self, session_id: str) -> None:
        self.tallies.pop(session_id, None)

    def metrics(self) -> dict[str, Any]:
        return {"sessions": len(self.tallies), "created": self.created}
