"""How a worker reaches another worker's private listener.

- `UnixEndpoints` (file claims, one host): ``<runtime dir>/workers/<id>.sock``.
- `TcpEndpoints` (Redis claims, several hosts): the ``host:port`` the worker
  registered in Redis (`WorkerRegistry`).

Both answer ``open`` with a stream pair or an `OSError` (refused, gone, not
registered, or no answer within the connect timeout), which the forwarder
turns into 410 ``session_gone``.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gym_sessions.routing.redis_claims import WorkerRegistry
    from gym_sessions.routing.runtime_dir import RuntimeDirectory

__all__ = ["TcpEndpoints", "UnixEndpoints", "WorkerEndpoints"]

_READ_LIMIT = 256 * 1024
# A host that is down does not refuse, it just never answers: give up on it
# after this long rather than holding the request.
_TCP_CONNECT_SECONDS = 2.0

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class WorkerEndpoints(Protocol):
    """Opens connections to other workers' private listeners."""

    async def open(self, worker_id: str) -> Streams:
        """A new connection to ``worker_id``; `OSError` if it cannot be reached."""

    async def reachable(self, worker_id: str) -> bool:
        """Whether ``worker_id`` accepts connections."""


class UnixEndpoints:
    """Private Unix sockets in the server's runtime directory."""

    def __init__(self, runtime_dir: RuntimeDirectory) -> None:
        self.socket_path = runtime_dir.socket_path

    async def open(self, worker_id: str) -> Streams:
        return await asyncio.open_unix_connection(self.socket_path(worker_id), limit=_READ_LIMIT)

    async def reachable(self, worker_id: str) -> bool:
        return await _accepts(self.open(worker_id))


class TcpEndpoints:
    """Private TCP listeners at the addresses workers registered in Redis."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def open(self, worker_id: str) -> Streams:
        address = await self.registry.lookup(worker_id)
        if address is None:
            raise ConnectionRefusedError(f"worker {worker_id} is not registered")
        host, port = address
        async with asyncio.timeout(_TCP_CONNECT_SECONDS):
            return await asyncio.open_connection(host, port, limit=_READ_LIMIT)

    async def reachable(self, worker_id: str) -> bool:
        return await _accepts(self.open(worker_id))


async def _accepts(opening: object) -> bool:
    try:
        _, writer = await opening  # type: ignore[misc]
    except OSError:
        return False
    writer.close()
    return True
