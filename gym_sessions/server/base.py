"""`SessionServer`: what the app factory needs from any server that keeps sessions.

Resources (and env) servers and agent servers differ in where requests name
their session and in how long a session lives, not in how they are served:
both get the worker's settings, claims and credentials through `bind`, answer
``/health``, and hand their routes to the app factory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from gym_sessions.credentials import SessionCredentials
from gym_sessions.errors import NotReadyError
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.session_ids import SessionIdSources
from gym_sessions.settings import Settings

if TYPE_CHECKING:
    from gym_sessions.metrics.recorder import WorkerMetrics
    from gym_sessions.routing.handoff import HandoffCounts
    from gym_sessions.routing.session_snapshots import SessionSnapshots

__all__ = ["SessionServer"]


class SessionServer:
    """Base of every server the app factory serves.

    Attributes:
        sources: Where requests name their session.
        close_paths: Routes that close a session (claimed before their handler).
        jsonrpc_paths: Routes whose errors are JSON-RPC error objects.
    """

    sources: ClassVar[SessionIdSources]
    close_paths: ClassVar[tuple[str, ...]] = ()
    jsonrpc_paths: ClassVar[tuple[str, ...]] = ()

    settings: Settings
    claims: OwnedClaims
    credentials: SessionCredentials
    #: Sessions this worker closed because they idled out.
    expired_total: int = 0
    #: This worker's operator metrics (set by the app factory; None with ``--metrics off``).
    operator_metrics: WorkerMetrics | None = None
    #: This worker's durable sessions (``--durable-sessions``), else ``None``.
    snapshots: SessionSnapshots | None = None
    #: Requests this worker sent on to their holder, handed over or hopped (routed workers).
    deliveries: HandoffCounts | None = None
    #: Why this worker should get no new traffic now (``/ready``), ``None`` when it should;
    #: set by the app factory (`gym_sessions.server.app.WorkerApp.unready_reason`).
    unready_reason: Callable[[], str | None] = staticmethod(lambda: None)

    def _attach(
        self, settings: Settings, claims: OwnedClaims, credentials: SessionCredentials
    ) -> None:
        """Attach the worker's settings, claims and credentials (the app factory's job).

        The library's own server classes extend it; a server of yours reads
        its settings in `configure` instead.
        """
        self.settings = settings
        self.claims = claims
        self.credentials = credentials
        self._changed: set[str] = set()

    def configure(self, settings: Settings) -> None:
        """Called once in each worker before it serves: read the settings here.

        Override it to set up what depends on the settings (``--unsandboxed``,
        say); ``self.settings`` holds them too. Does nothing by default.
        """

    def count_expired(self) -> None:
        """Count a session this worker closed because it idled out (``/health``, ``/metrics``)."""
        self.expired_total += 1
        if self.operator_metrics is not None:
            self.operator_metrics.session_expired()

    def check_settings(self, settings: Settings) -> None:
        """Refuse settings this server cannot run with (raise `StartupError`).

        The supervisor calls it once before any worker starts, so a refusal is
        one line and exit status 2 rather than a failure in every worker.
        """

    @property
    def start_paths(self) -> tuple[str, ...]:
        """Routes that start a session (claimed before their handler)."""
        return ()

    @property
    def runs_to_completion_paths(self) -> tuple[str, ...]:
        """Routes whose handler is not cancelled when its client disconnects.

        Starts and closes change a session's lifetime: cut short, a start could
        leave half-made state and a close an unreleased one, so they finish and
        their reply is dropped. Every other handler is cancelled at its next
        ``await`` (`gym_sessions.routing.disconnect`).
        """
        return (*self.start_paths, *self.close_paths)

    def session_id(self, request: Request) -> str:
        """The request's session id; reading it counts as using the session."""
        return request.session[self.sources.cookie_key]

    def routes(self) -> list[BaseRoute]:
        """Every route of the server, without the rollout prefix."""
        return [
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
        ]

    def middleware(self) -> list[Middleware]:
        """ASGI middleware around the routes, inside the router and the session cookie."""
        return []

    def metrics(self) -> dict[str, Any]:
        """Extra fields for ``/health`` (for example, sessions held)."""
        return {}

    async def background(self) -> None:
        """Work the server runs in the background while it serves (none by default)."""

    def release_all(self) -> None:
        """Drop every session's state (the worker is shutting down)."""

    # Durable sessions (docs/design.md §3.14) -------------------------------------------

    def export_session(self, session_id: str) -> bytes | None:
        """The session's state as bytes for its snapshot, or ``None``: it is not durable.

        Called after a request that changed the session (`session_changed`),
        before its reply. Whatever it returns, `import_session` must rebuild
        on another worker of the same server.
        """
        return None

    def import_session(self, session_id: str, data: bytes) -> None:
        """Rebuild ``session_id`` here from `export_session`'s bytes (its holder died)."""
        raise NotImplementedError(f"{type(self).__name__} does not restore sessions")

    def durability(self) -> str | None:
        """How this server's sessions are captured, or ``None`` if they cannot be.

        The supervisor logs one warning at start-up when durable sessions were
        asked for and this is ``None``.
        """
        return None

    def session_changed(self, session_id: str) -> None:
        """A request changed the session's state: its snapshot is written before the reply."""
        self._changed.add(session_id)

    def take_changed(self, session_id: str) -> bool:
        """Whether the session changed since the last call (and forget that it did)."""
        if session_id in self._changed:
            self._changed.discard(session_id)
            return True
        return False

    async def _ready(self, request: Request) -> JSONResponse:
        # Readiness, apart from /health (liveness): a load balancer sends new
        # sessions only to a 200 here, while a 503 worker still serves its own.
        reason = self.unready_reason()
        if reason is None:
            return JSONResponse({"status": "ready", "worker": self.claims.worker_id})
        raise NotReadyError(f"worker {self.claims.worker_id} is not ready: {reason}")

    async def _health(self, request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ok",
                "worker": self.claims.worker_id,
                "open_sessions": self.claims.live_sessions,
                "max_sessions": self.claims.max_sessions or None,
                "expired_sessions": self.expired_total,
                "draining": not self.claims.accepting_sessions,
                **(
                    {}
                    if self.snapshots is None
                    else {"restored_sessions": self.snapshots.restored_total}
                ),
                **({} if self.deliveries is None else {"deliveries": self.deliveries.as_json()}),
                **self.metrics(),
            }
        )
