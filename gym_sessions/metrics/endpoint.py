"""`MetricsMiddleware`: counts every public request and answers ``GET /metrics``.

``GET /metrics`` is the framework's, before any route of the server; other
methods on that path reach the server's routes like any request (404 unless
the server has such a route, a tool named ``metrics`` say).

Pure ASGI and outermost in a worker's stack (outside `SessionRouter`), so
``/metrics`` needs no session id, claim or store call, and every request is
counted once, by the worker that accepted it, whatever the router did with it.
Requests that arrived over a private listener (forwarded by another worker)
pass through uncounted: their accepting worker counts them.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_sessions.error_reply import send_error
from gym_sessions.errors import HTTPError, InvalidTokenError, unexpected_error
from gym_sessions.metrics.access import MetricsAccess
from gym_sessions.metrics.recorder import CONTENT_TYPE, WorkerMetrics
from gym_sessions.scope_keys import (
    GIVEN_AWAY_SCOPE_KEY,
    PRIVATE_SCOPE_KEY,
    SERVED_SCOPE_KEY,
    Served,
)

__all__ = ["METRICS_PATH", "MetricsMiddleware"]

METRICS_PATH = "/metrics"

logger = logging.getLogger("gym_sessions.metrics")


class MetricsMiddleware:
    """Counts public requests into ``metrics`` and serves its page at `METRICS_PATH`.

    Args:
        app: The worker's router.
        metrics: This worker's metrics.
        access: Who may read the page.
    """

    def __init__(self, app: ASGIApp, metrics: WorkerMetrics, access: MetricsAccess) -> None:
        self.app = app
        self.metrics = metrics
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get(PRIVATE_SCOPE_KEY, False):
            await self.app(scope, receive, send)
            return
        status: int | None = None
        counted = False

        def count() -> None:
            nonlocal counted
            counted = True
            if scope.get(GIVEN_AWAY_SCOPE_KEY, False):
                return  # the worker the connection was handed to counts the request
            served = scope.get(SERVED_SCOPE_KEY, Served.LOCAL)
            self.metrics.request_done(scope["path"], status, served)

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif (
                message["type"] == "http.response.body"
                and not message.get("more_body", False)
                and not counted
            ):
                # Before the last byte goes out: a client holding its reply can
                # already read it in /metrics, whichever worker answers that.
                count()
            await send(message)

        try:
            # GET only: another method passes on, so a server's own tool named
            # "metrics" (POST /metrics) still reaches its route.
            if scope["path"] == METRICS_PATH and scope["method"] == "GET":
                await self._answer(scope, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            if not counted:
                count()  # the reply broke off, or none was started (status "none")

    async def _answer(self, scope: Scope, send: Send) -> None:
        try:
            self.access.check(scope)
        except HTTPError as error:
            if isinstance(error, InvalidTokenError):
                send = _with_header(send, (b"www-authenticate", b'Bearer realm="gym-sessions"'))
            await send_error(send, error)
            return
        # File reads of every worker's metrics: off the event loop.
        try:
            page = await asyncio.to_thread(self.metrics.render)
        except Exception as exc:  # unreadable files (descriptors exhausted, say): a JSON error
            logger.exception("rendering /metrics failed")
            await send_error(send, unexpected_error(exc))
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", CONTENT_TYPE.encode()),
                    (b"content-length", str(len(page)).encode()),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": page})


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    async def send_with_header(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), header]
        await send(message)

    return send_with_header
