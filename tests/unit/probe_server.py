"""A resources server for routing tests: each route uses the session in one known way."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import BaseRoute, Route

from gym_sessions.errors import EnvError
from gym_sessions.server.bodies import BodySchema, read_json
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool


class ProbeServer(ResourcesServer):
    """Keeps a counter per session; every reply names the worker that served it.

    Routes:
        /seed_session, /reset: typed or untyped starts (``{"fail": true}`` makes the start 500,
            ``{"hold": true}`` makes it wait for its gate).
        /blind_start: a session start whose handler never reads the session.
        /touch: reads the session and counts (creates a session implicitly).
        /nothing: never reads the session.
        /fail_touch: reads the session, then fails with 500.
        /echo: returns method, path, query, headers and a body digest; writes session data.
        /sleep: reads the session, sleeps ``seconds``.
        /hold: reads the session, waits for its gate.

    A held request waits until the test opens its session's gate
    (``held[sid].set()``); the gate appears in `held` once the request is in its
    handler, so the test knows it is in flight without timing it.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.released: list[str] = []
        self.task_sizes: dict[str, int] = {}
        self.before_touch: Callable[[str], None] | None = None  # lets a test inject a race
        self.held: dict[str, asyncio.Event] = {}

    @property
    def worker(self) -> str:
        return self.claims.worker_id

    async def start_session(self, sid: str, body: dict[str, Any], path: str) -> dict:
        self.counts.setdefault(sid, 0)
        self.task_sizes[sid] = len(body.get("task", ""))
        if body.get("fail"):
            raise EnvError("start failed on purpose")
        if body.get("hold"):
            await self._gate(sid)
        return {"worker": self.worker, "task_size": self.task_sizes[sid]}

    async def verify_session(self, sid: str, body: dict[str, Any]) -> dict:
        return {"reward": 1.0, "count": self.counts.get(sid), "worker": self.worker}

    def release_session(self, sid: str) -> None:
        if self.counts.pop(sid, None) is not None:
            self.released.append(sid)

    def metrics(self) -> dict[str, Any]:
        return {"sessions": len(self.counts)}

    def routes(self) -> list[BaseRoute]:
        # First, so it shadows the base start route that settings add for this path.
        return [Route("/blind_start", self.blind_start, methods=["POST"]), *super().routes()]

    def tools(self) -> list[Tool]:
        async def count(request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
            sid = session_id(request)
            return {"worker": self.worker, "sid": sid, "count": self.counts.get(sid)}

        return [Tool("count", "Read this session's counter.", BodySchema(), count)]

    def extra_routes(self) -> list[BaseRoute]:
        return [
            Route("/touch", self.touch, methods=["POST"]),
            Route("/nothing", self.nothing, methods=["GET", "POST"]),
            Route("/fail_touch", self.fail_touch, methods=["POST"]),
            Route("/echo", self.echo, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
            Route("/sleep", self.sleep, methods=["POST"]),
            Route("/hold", self.hold, methods=["POST"]),
            Route("/stream", self.stream, methods=["GET"]),
        ]

    async def blind_start(self, request: Request) -> JSONResponse:
        return JSONResponse({"worker": self.worker})

    async def touch(self, request: Request) -> JSONResponse:
        sid = session_id(request)
        if self.before_touch is not None:
            self.before_touch(sid)
        self.counts[sid] = self.counts.get(sid, 0) + 1
        return JSONResponse({"worker": self.worker, "sid": sid, "count": self.counts[sid]})

    async def nothing(self, request: Request) -> JSONResponse:
        return JSONResponse({"worker": self.worker})

    async def fail_touch(self, request: Request) -> JSONResponse:
        session_id(request)
        raise EnvError("tool failed on purpose")

    async def echo(self, request: Request) -> JSONResponse:
        body = await request.body()
        request.session["echoed"] = True
        return JSONResponse(
            {
                "worker": self.worker,
                "method": request.method,
                "path": request.url.path,
                "query": request.url.query,
                "headers": [[k, v] for k, v in request.headers.items()],
                "body_sha256": hashlib.sha256(body).hexdigest(),
                "body_size": len(body),
            }
        )

    async def stream(self, request: Request) -> StreamingResponse:
        """``n`` chunks of 64 KiB, chunked transfer, with the session used."""
        session_id(request)
        n = int(request.query_params.get("n", "4"))

        async def chunks():
            for i in range(n):
                yield bytes([i % 256]) * 65536
                await asyncio.sleep(0)

        return StreamingResponse(chunks(), media_type="application/octet-stream")

    async def sleep(self, request: Request) -> JSONResponse:
        sid = session_id(request)
        body = await read_json(request) or {}
        await asyncio.sleep(float(body.get("seconds", 0.1)))
        return JSONResponse({"worker": self.worker, "sid": sid})

    async def hold(self, request: Request) -> JSONResponse:
        sid = session_id(request)
        await self._gate(sid)
        return JSONResponse({"worker": self.worker, "sid": sid})

    async def _gate(self, sid: str) -> None:
        await self.held.setdefault(sid, asyncio.Event()).wait()
