"""The app factory: one settings object and one server give a worker's ASGI app.

The stack, outside in: `WebSocketSessions` (``/ws``), `MetricsMiddleware`
(unless ``--metrics off``), `CompressedReplies` (zstd for binary replies a
client asks it for), then `SessionRouter` (the routing rule; ``request.session`` and the cookie with
`SessionCookie`), then the Starlette app with the server's routes, bare and
under ``/rollouts/{id}/``.
With several workers and routing on, the app also runs the worker's private
listener and claim sweep from its lifespan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gym_sessions.credentials import SessionCredentials
from gym_sessions.errors import (
    HTTPError,
    MethodNotAllowedError,
    NotFoundError,
    error_body,
    error_headers,
    unexpected_error,
)
from gym_sessions.metrics import (
    METRICS_PATH,
    MetricsAccess,
    MetricsDirectory,
    MetricsMiddleware,
    WorkerMetrics,
)
from gym_sessions.routing.body_budget import BodyBudget
from gym_sessions.routing.claim_store import LocalClaimStore
from gym_sessions.routing.forwarder import Forwarder
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.placement import Placement
from gym_sessions.routing.router import SessionRouter
from gym_sessions.routing.session_snapshots import SessionSnapshots
from gym_sessions.routing.snapshot_store import (
    SnapshotCodec,
)
from gym_sessions.routing.step_batch import STEP_BATCH_PATH, StepBatchRoute
from gym_sessions.runtime_dir import (
    SERVER_MARK,
    SERVING,
    STOPPING,
    RuntimeDirectory,
    worker_process_exists,
)
from gym_sessions.server.backends import backend_for
from gym_sessions.server.base import SessionServer
from gym_sessions.server.reply_compression import CompressedReplies
from gym_sessions.server.resources import ResourcesServer
from gym_sessions.server.route_table import RouteTable
from gym_sessions.server.websocket_sessions import WebSocketSessions
from gym_sessions.settings import Settings
from gym_sessions.transport.private_listener import PrivateListener
from gym_sessions.transport.supervisor import SupervisedApp

__all__ = ["WorkerApp", "create_app", "new_worker_id"]

logger = logging.getLogger("gym_sessions.server")

# A shutting-down worker keeps its private listener until forwarded requests
# have stopped coming for this long.
_FORWARD_QUIET_SECONDS = 0.5


def new_worker_id() -> str:
    """A worker id unique across replacements: the pid alone is reused."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def _error_response(error: HTTPError) -> Response:
    headers = {name.decode(): value.decode() for name, value in error_headers(error)}
    return Response(
        error_body(error), status_code=error.status, headers=headers, media_type="application/json"
    )


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPError)
    return _error_response(exc)


async def _on_starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error: HTTPError
    if exc.status_code == 404:
        error = NotFoundError(f"no route {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path}")
    else:
        error = HTTPError(str(exc.detail))
        error.status = exc.status_code  # type: ignore[misc]
    return _error_response(error)


async def _on_unexpected_error(request: Request, exc: Exception) -> Response:
    return _error_response(unexpected_error(exc))


class WorkerApp(SupervisedApp):
    """The ASGI app of one worker.

    Args:
        server: The server (resources, env adapter or agent) this worker serves.
        settings: Server settings; ``runtime_dir`` set means this worker routes.
        worker_id: This worker's id (a fresh one by default).
    """

    def __init__(self, server: SessionServer, settings: Settings, worker_id: str | None = None):
        self.server = server
        self.settings = settings
        self.worker_id = worker_id or new_worker_id()
        self.credentials = SessionCredentials(settings.secret, settings.session_cookie)
        self._stopping = False
        #: What this worker shares with the others (`gym_sessions.server.backends`);
        #: ``None`` when it does not route.
        self.backend = backend_for(settings, self.worker_id, self._takes_connection)
        backend = self.backend
        self.forwarder: Forwarder | None = backend.forwarder if backend else None
        self.handoff = backend.handoff if backend else None
        self.handoff_listener = backend.handoff_listener if backend else None
        self.claims = OwnedClaims(
            backend.claim_store if backend else LocalClaimStore(),
            self.worker_id,
            settings.session_close_retry_window_seconds,
            standing=backend.standing() if backend else None,
            max_sessions=settings.max_sessions,
            idle_timeout=settings.session_idle_timeout,
            owner_cache=backend.owner_cache() if backend else None,
        )
        server._attach(settings, self.claims, self.credentials)
        server.configure(settings)
        server.unready_reason = self.unready_reason
        self.snapshots: SessionSnapshots | None = None
        if backend is not None and backend.snapshot_store is not None:
            self.snapshots = server.snapshots = SessionSnapshots(
                backend.snapshot_store,
                self.claims,
                SnapshotCodec(settings.secret),
                server.export_session,
                server.import_session,
                server.take_changed,
                settings.max_snapshot_bytes,
                capturable=server.durability() is not None,
            )

        routes = server.routes()
        self.metrics: WorkerMetrics | None = None
        if settings.metrics:
            templates = [route.path for route in routes if isinstance(route, Route)]
            if isinstance(server, ResourcesServer) and server.batch_steps() is not None:
                templates.append(STEP_BATCH_PATH)  # answered by the router, not a route
            self.metrics = self._start_metrics(server, templates)
        all_routes = [*routes, Mount("/rollouts/{rollout_id}", routes=routes)]
        starlette = Starlette(
            routes=all_routes,
            middleware=server.middleware(),
            exception_handlers={
                HTTPError: _on_http_error,
                HTTPException: _on_starlette_error,
                Exception: _on_unexpected_error,
            },
            lifespan=self._lifespan,
        )
        # The same routes, fixed paths found without Starlette's regex scan.
        starlette.router = RouteTable(all_routes, lifespan=self._lifespan)
        self.router = self.app = SessionRouter(
            starlette,
            sources=server.sources,
            credentials=self.credentials,
            claims=self.claims,
            forwarder=self.forwarder,
            start_paths=server.start_paths,
            close_paths=server.close_paths,
            jsonrpc_paths=server.jsonrpc_paths,
            max_body_bytes=settings.max_body_bytes,
            max_header_bytes=settings.max_header_bytes,
            body_read_timeout_seconds=settings.body_read_timeout_seconds,
            debug_worker_header=settings.debug_worker_header,
            forward_signer=backend.forward_signer if backend else None,
            trust_session_ids=settings.trust_session_ids,
            worker_ids=backend.endpoints.worker_ids if backend else None,
            body_budget=BodyBudget(settings.max_inflight_body_bytes),
            runs_to_completion=server.runs_to_completion_paths,
            snapshots=self.snapshots,
            handoff=self.handoff,
        )
        if self.forwarder is not None:
            server.deliveries = self.router.deliveries
        steps = server.batch_steps() if isinstance(server, ResourcesServer) else None
        if steps is not None:
            self.router.step_batch = StepBatchRoute(
                steps,
                sources=server.sources,
                credentials=self.credentials,
                claims=self.claims,
                access=self.router.access,
                forwarder=self.forwarder,
                snapshots=self.snapshots,
                record_step=lambda seconds: _record_step(server, seconds),
                handoff=self.router.handoff,
            )
        # Outermost: /metrics and the request counts, around the routing rule;
        # inside them, the compression of binary replies for the client.
        self._entry: ASGIApp = CompressedReplies(self.router)
        if self.metrics is not None:
            self._entry = MetricsMiddleware(
                self._entry, self.metrics, MetricsAccess(settings.metrics_token)
            )
        # Around both: a WebSocket's messages are served as requests by the stack inside.
        self._entry = WebSocketSessions(self._entry, settings.session_cookie)
        self._background: list[asyncio.Task[None]] = []
        self._listener: PrivateListener | None = None
        # Where the workers of this server mark their shutdown (any routed
        # server's supervisor makes one); None with one worker in-process.
        self.coordination = (
            RuntimeDirectory(settings.runtime_dir) if settings.runtime_dir is not None else None
        )
        self._leaving = False

    def _start_metrics(self, server: SessionServer, routes: list[str]) -> WorkerMetrics:
        """This worker's metrics, fed by the server (tools, expiries) and the claims (counts)."""
        runtime_dir = self.settings.runtime_dir
        directory = MetricsDirectory.of(runtime_dir) if runtime_dir is not None else None
        metrics = WorkerMetrics(self.worker_id, [*routes, METRICS_PATH], directory)
        server.operator_metrics = metrics
        claims = self.claims
        claims.on_count_change(lambda: metrics.counts(len(claims), claims.live_sessions))
        if self.snapshots is not None:
            self.snapshots.on_saved = metrics.snapshot_written
            self.snapshots.on_restored = metrics.session_restored
        return metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._entry(scope, receive, send)

    def serve_handed_connections(
        self, new_protocol: Callable[[], Any], accepting: Callable[[], bool]
    ) -> None:
        """Serve connections other workers hand here with the public server's protocol.

        Called by the public server once it listens: ``new_protocol()`` makes
        its protocol for one connection (with its config and connection set),
        ``accepting()`` tells whether it still accepts connections. Without
        this call every handoff is refused and requests reach here by the hop.
        """
        if self.handoff_listener is not None:
            self.handoff_listener.attach(new_protocol, accepting)

    @property
    def takes_handed_connections(self) -> bool:
        """Whether other workers may hand this one client connections (handoff on)."""
        return self.handoff_listener is not None

    @property
    def drain_timeout(self) -> float:
        return self.settings.drain_timeout

    @property
    def open_sessions(self) -> int:
        return self.claims.live_sessions

    def release_sessions(self) -> None:
        self.server.release_all()

    def _takes_connection(self, session_id: str) -> bool:
        """Whether a connection handed over for ``session_id`` is served here."""
        claims = self.claims
        return not self._stopping and claims.accepting_sessions and session_id in claims

    async def startup(self) -> None:
        """Start the claim sweep and, when routing, the private listener (and its registration)."""
        if self.backend is not None:
            self._listener = self.backend.private_listener(self)
            await self._listener.start()
            try:
                self._background += await self.backend.start(self._listener, self._restore_claims)
            except BaseException:
                # Unreachable Redis fails the worker's start-up, like a bad port.
                await self._listener.stop()
                raise
        if self.settings.routed and self.settings.placement == "balanced":
            # Once this worker listens: a record names a worker starts can reach.
            assert self.backend is not None
            self.router.placement = Placement(self.claims, self.backend.load_board())
            self.router.placement.publish()
        if self.coordination is not None:
            self.coordination.mark(self.worker_id, SERVING)
        self._background += [
            asyncio.create_task(self.claims.run_sweeper()),
            asyncio.create_task(self.server.background()),
        ]
        logger.debug("worker %s started", self.worker_id)

    async def _restore_claims(self) -> None:
        lost = await self.claims.restore()
        logger.warning(
            "worker %s: its registration had lapsed; claims written again (%d taken meanwhile)",
            self.worker_id,
            lost,
        )

    def begin_drain(self) -> None:
        """Take no new session here (starts go to other workers); serve the open ones on."""
        self.claims.accepting_sessions = False
        if self.router.placement is not None:
            self.router.placement.publish()  # takes no new sessions: others stop sending them
        logger.info("worker %s drains: %d open sessions", self.worker_id, self.claims.live_sessions)

    async def drained(self) -> None:
        """Return once this worker holds no open session (polls: sessions end on any path).

        With durable sessions, also once every open session can be handed over
        (`SessionSnapshots.can_hand_over`): the worker then leaves at once, and
        each session is restored where its next request lands after it exited.
        """
        while self.claims.live_sessions > 0:
            if self.snapshots is not None and self.snapshots.can_hand_over():
                logger.info(
                    "worker %s hands its %d open sessions over (durable)",
                    self.worker_id,
                    self.claims.live_sessions,
                )
                return
            await asyncio.sleep(0.2)

    def unready_reason(self) -> str | None:
        """Why this worker should get no new traffic (``GET /ready`` 503), or ``None``.

        Unready from the moment a drain or a shutdown starts, the whole
        server's included (the supervisor's ``server.stopping`` mark), so a
        load balancer stops sending new sessions while the open ones finish.
        """
        if self._stopping:
            return "shutting down"
        if not self.claims.accepting_sessions:
            return "draining"
        if self.coordination is not None and SERVER_MARK in self.coordination.workers_in(STOPPING):
            return "the server is stopping"
        return None

    def leave_server(self) -> None:
        """This worker leaves alone (drained, orphaned): nobody waits for it at shutdown."""
        self._leaving = True
        if self.coordination is not None:
            self.coordination.mark(self.worker_id, SERVING, present=False)

    async def _finish_forwarded_requests(self) -> None:
        """Serve what other workers forward here until they are done (bounded).

        On SIGTERM every worker stops accepting at once, but a request another
        worker had already received may reach it later (that worker's loop may
        be busy with a long step): keep listening until every worker of this
        server has finished its own requests (its ``stopping`` mark) when the
        whole server stops, then until no forwarded request is in flight and
        none came for a moment.
        """
        router = self.router
        deadline = time.monotonic() + self.settings.graceful_timeout
        whole_server_stops = (
            self.coordination is not None
            and not self._leaving
            and SERVER_MARK in self.coordination.workers_in(STOPPING)
        )
        if whole_server_stops:
            assert self.coordination is not None
            self.coordination.mark(self.worker_id, STOPPING)
            while time.monotonic() < deadline and self._others_still_serving():  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        while time.monotonic() < deadline:
            quiet = time.monotonic() - router.private_done_at >= _FORWARD_QUIET_SECONDS
            if router.private_in_flight == 0 and quiet:
                return
            await asyncio.sleep(0.05)

    def _others_still_serving(self) -> bool:
        assert self.coordination is not None
        waiting = self.coordination.workers_in(SERVING) - self.coordination.workers_in(STOPPING)
        return any(worker_process_exists(worker_id) for worker_id in waiting)

    async def shutdown(self) -> None:
        """Stop background work and the private listener; release this worker's sessions."""
        self._stopping = True  # no connection is taken from now on
        if self.handoff_listener is not None:
            await self.handoff_listener.stop()
        if self.handoff is not None:
            self.handoff.close()
        # The heartbeat first: a beat after the unregistration would register again.
        for task in self._background:
            task.cancel()
            # A background task that failed must not keep the rest from closing.
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.router.placement is not None:
            # Before the listener goes: no start is placed on a worker that left.
            with contextlib.suppress(Exception):
                await self.router.placement.close()
        if self.backend is not None:
            await self.backend.leave()  # other workers answer 410 for its sessions at once
        if self._listener is not None:
            await self._finish_forwarded_requests()
            await self._listener.stop()
        if self.coordination is not None:
            self.coordination.mark(self.worker_id, SERVING, present=False)
            self.coordination.mark(self.worker_id, STOPPING, present=False)
        if self.forwarder is not None:
            await self.forwarder.close()
        await self.claims.wait_for_store()
        if self.backend is not None:
            await self.backend.close()
        # Claims stay: requests for these sessions must get 410, not empty state,
        # until the server exits and its runtime directory goes.
        self.server.release_all()

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.startup()
        try:
            yield
        finally:
            await self.shutdown()


def create_app(server: SessionServer, settings: Settings | None = None) -> WorkerApp:
    """The ASGI app of one worker serving ``server`` with ``settings``."""
    return WorkerApp(server, settings or Settings())


def _record_step(server: SessionServer, seconds: float) -> None:
    """A batch entry's step time, in the tool-call series of ``/step`` (operator metrics)."""
    metrics = server.operator_metrics
    if metrics is not None:
        metrics.tool_call("step", "http", seconds)
