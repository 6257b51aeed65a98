"""Where a routed server's workers share what they share: one backend object per kind.

A routed worker needs a claim store, a snapshot store (durable sessions), a
load board (balanced placement), a way to reach the other workers and a
private listener for them to reach it. These come in two kinds, chosen once
from the settings by `backend_for`:

- `FileBackend` (one host, ``--claims file``): files in the server's runtime
  directory, private Unix sockets, connection handoff.
- `RedisBackend` (several hosts, ``--claims redis://...``): claims, snapshots,
  load records and worker registrations in Redis, private TCP listeners,
  forwarded requests signed with the secret.

`WorkerApp` wires whichever it gets and asks nothing of its kind.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from gym_sessions.routing.claim_store import ClaimStore, FileClaimStore
from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.routing.handoff import Handoff, HandoffCounts
from gym_sessions.routing.handoff_listener import HandoffListener
from gym_sessions.routing.owned_claims import EXPIRY_MARGIN_SECONDS
from gym_sessions.routing.owner_cache import OwnerCache
from gym_sessions.routing.placement import FileLoadBoard, LoadBoard, RedisLoadBoard
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.routing.redis_connection import connect_redis, connect_redis_blocking
from gym_sessions.routing.redis_registry import EntrySigner, WorkerRegistry
from gym_sessions.routing.snapshot_store import (
    FileSnapshotStore,
    RedisSnapshotStore,
    SnapshotStore,
)
from gym_sessions.routing.stream_forwarder import StreamForwarder
from gym_sessions.routing.worker_endpoints import TcpEndpoints, UnixEndpoints, WorkerEndpoints
from gym_sessions.runtime_dir import RuntimeDirectory
from gym_sessions.settings import Settings
from gym_sessions.transport.private_listener import FORWARD_HEAD_ALLOWANCE, PrivateListener

if TYPE_CHECKING:
    from starlette.types import ASGIApp

__all__ = ["Backend", "FileBackend", "RedisBackend", "backend_for"]

logger = logging.getLogger("gym_sessions.server")

# No credential reaches a session after this long (cookies and tokens last 14 days).
_CREDENTIAL_SECONDS = 14 * 24 * 3600.0


def snapshot_lifetime(settings: Settings) -> float:
    """How long a Redis snapshot lasts after its last write: past it, no restore can need it.

    An open session idles out after ``session_idle_timeout`` (its snapshot
    then describes a closed session); without one, no cookie or token reaches
    it after 14 days. Plus the window and margin a claim itself outlives its
    last request by.
    """
    idle = settings.session_idle_timeout or _CREDENTIAL_SECONDS
    return (
        min(idle, _CREDENTIAL_SECONDS)
        + settings.session_close_retry_window_seconds
        + EXPIRY_MARGIN_SECONDS
    )


class Backend(abc.ABC):
    """The shared state and the reach of one routed worker (see the module)."""

    #: Where this worker's claims live.
    claim_store: ClaimStore
    #: Durable sessions' snapshots (``--durable-sessions``), else ``None``.
    snapshot_store: SnapshotStore | None = None
    #: How this worker reaches the others.
    endpoints: WorkerEndpoints
    #: Signs forwarded requests (private listeners on TCP), else ``None``.
    forward_signer: ForwardSigner | None = None
    #: Connection handoff (``--handoff on``, one host), else ``None``.
    handoff: Handoff | None = None
    #: Serves connections handed to this worker, with `handoff`.
    handoff_listener: HandoffListener | None = None

    def __init__(self, settings: Settings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.forwarder: StreamForwarder

    def standing(self) -> Callable[[], bool] | None:
        """Whether this worker may answer from memory now (``None``: always)."""
        return None

    def owner_cache(self) -> OwnerCache | None:
        """A cache of other workers' claims, where a lookup costs a round trip."""
        return None

    @abc.abstractmethod
    def private_listener(self, app: ASGIApp) -> PrivateListener:
        """The listener other workers forward this worker's sessions' requests to."""

    @abc.abstractmethod
    def load_board(self) -> LoadBoard:
        """Where workers publish their loads for balanced placement."""

    async def start(
        self,
        listener: PrivateListener,
        restore_claims: Callable[[], Awaitable[None]],
    ) -> list[asyncio.Task[None]]:
        """Make this worker reachable once its listener listens; its background tasks.

        ``restore_claims`` runs when this worker's registration had lapsed
        (Redis), to write its claims again.
        """
        return []

    @abc.abstractmethod
    async def leave(self) -> None:
        """Stop being reachable (before the listener stops): others answer 410 at once.

        (Connection handoff stops before this, with `handoff_listener`.)
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Close what this backend holds open."""


class FileBackend(Backend):
    """One host: files in the server's runtime directory, Unix sockets, connection handoff.

    Args:
        settings: The server's settings (``runtime_dir`` set: the supervisor's).
        worker_id: This worker's id.
        takes_connection: For handoff: whether a connection handed over for a
            session id is served here.
    """

    def __init__(
        self, settings: Settings, worker_id: str, takes_connection: Callable[[str], bool]
    ) -> None:
        super().__init__(settings, worker_id)
        if settings.runtime_dir is None:
            raise ValueError("a routed worker needs the runtime directory of its server")
        self.runtime_dir = RuntimeDirectory(settings.runtime_dir)
        file_snapshots = None
        if settings.durable_sessions:
            self.snapshot_store = file_snapshots = FileSnapshotStore(self.runtime_dir.snapshots_dir)
        self.claim_store = FileClaimStore(self.runtime_dir.claims_dir, worker_id, file_snapshots)
        self.endpoints = UnixEndpoints(self.runtime_dir)
        self.forwarder = StreamForwarder(self.endpoints)
        if settings.handoff:
            self.handoff = Handoff(worker_id, self.runtime_dir.handoff_path, HandoffCounts())
            self.handoff_listener = HandoffListener(
                self.runtime_dir.handoff_path(worker_id), takes_connection
            )

    def private_listener(self, app: ASGIApp) -> PrivateListener:
        return PrivateListener(
            app,
            self.runtime_dir.socket_path(self.worker_id),
            max_head_bytes=self.settings.max_header_bytes + FORWARD_HEAD_ALLOWANCE,
        )

    def load_board(self) -> LoadBoard:
        return FileLoadBoard(self.runtime_dir.load_dir, self.worker_id)

    async def leave(self) -> None:
        # Nothing registers a worker here: its private socket refusing, once
        # its listener stops, is what tells the others it is gone.
        return None

    async def close(self) -> None:
        return None  # files hold nothing open between requests

    async def start(
        self,
        listener: PrivateListener,
        restore_claims: Callable[[], Awaitable[None]],
    ) -> list[asyncio.Task[None]]:
        if self.handoff_listener is not None:
            await self.handoff_listener.start()
        return []


class RedisBackend(Backend):
    """Several hosts: claims, snapshots, loads and registrations in Redis; private TCP."""

    def __init__(self, settings: Settings, worker_id: str) -> None:
        super().__init__(settings, worker_id)
        self.registry = WorkerRegistry(
            connect_redis(settings.claims),
            worker_id,
            EntrySigner(settings.secret),
            renewal_client=connect_redis_blocking(settings.claims),
            deadline=settings.claims_timeout,
        )
        self.redis_store = self.claim_store = RedisClaimStore(
            self.registry.client,
            self.registry,
            settings.session_close_retry_window_seconds + EXPIRY_MARGIN_SECONDS,
            keep_orphans_seconds=(
                snapshot_lifetime(settings) if settings.durable_sessions else 0.0
            ),
        )
        self.forward_signer = ForwardSigner(settings.secret)
        if settings.durable_sessions:
            self.snapshot_store = RedisSnapshotStore(
                self.registry.client, settings.claims_timeout, snapshot_lifetime(settings)
            )
        self.endpoints = TcpEndpoints(self.registry, settings.allowed_peer_networks())
        self.forwarder = StreamForwarder(self.endpoints, self.forward_signer)
        self._board: RedisLoadBoard | None = None

    def standing(self) -> Callable[[], bool] | None:
        # Others may take this worker's claims over once its registration has
        # expired and a reader or the reaper gave them an orphan's expiry.
        return self.redis_store.standing

    def owner_cache(self) -> OwnerCache | None:
        return OwnerCache()  # a lookup is a Redis round trip; a file read is not

    def private_listener(self, app: ASGIApp) -> PrivateListener:
        return PrivateListener(
            app,
            host=self.settings.private_host,
            max_head_bytes=self.settings.max_header_bytes + FORWARD_HEAD_ALLOWANCE,
            max_connections=self.settings.private_max_connections,
            idle_timeout=self.settings.private_idle_timeout,
        )

    def load_board(self) -> LoadBoard:
        self._board = RedisLoadBoard(
            self.registry.client,
            self.worker_id,
            self.registry.key_prefix,
            self.settings.claims_timeout,
        )
        return self._board

    async def start(
        self,
        listener: PrivateListener,
        restore_claims: Callable[[], Awaitable[None]],
    ) -> list[asyncio.Task[None]]:
        assert listener.address is not None
        await self.registry.register(*listener.address)

        async def restore() -> None:
            if self._board is not None:
                self._board.republish()  # Redis may have lost the load records too
            await restore_claims()

        return [asyncio.create_task(self.registry.run_heartbeat(restore, self._reap_orphans))]

    async def _reap_orphans(self) -> None:
        reaped = await self.redis_store.reap_orphans()
        if reaped:
            logger.info(
                "worker %s: %d claims of dead workers set to expire", self.worker_id, reaped
            )

    async def leave(self) -> None:
        with contextlib.suppress(Exception):
            await self.registry.unregister()

    async def close(self) -> None:
        await self.redis_store.close()


def backend_for(
    settings: Settings, worker_id: str, takes_connection: Callable[[str], bool]
) -> Backend | None:
    """The backend a worker of ``settings`` uses; ``None`` when it does not route."""
    if not settings.routed:
        return None
    if settings.redis_claims:
        return RedisBackend(settings, worker_id)
    return FileBackend(settings, worker_id, takes_connection)
