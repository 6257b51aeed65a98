"""How a worker reaches another worker's private listener.

- `UnixEndpoints` (file claims, one host): ``<runtime dir>/workers/<id>.sock``.
- `TcpEndpoints` (Redis claims, several hosts): the ``host:port`` the worker
  registered in Redis (`WorkerRegistry`).

Both answer ``open`` with a stream pair or an `OSError`: refused, gone or not
registered, which the forwarder turns into 410 ``session_gone``, or
`TimeoutError` (no answer within the connect timeout: maybe only slow), 502.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING, Protocol

from gym_sessions.errors import out_of_resources

if TYPE_CHECKING:
    from gym_sessions.routing.redis_claims import WorkerRegistry
    from gym_sessions.routing.runtime_dir import RuntimeDirectory

__all__ = ["TcpEndpoints", "UnixEndpoints", "WorkerEndpoints"]

_READ_LIMIT = 256 * 1024
# A host that is down does not refuse, it just never answers: give up on it
# after this long rather than holding the request.
_TCP_CONNECT_SECONDS = 2.0
# First probe after 10 s idle, then every 3 s; 3 unanswered: the peer is gone.
_KEEPALIVE_PROBES = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 3), ("TCP_KEEPCNT", 3))

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class WorkerEndpoints(Protocol):
    """Opens connections to other workers' private listeners."""

    async def open(self, worker_id: str) -> Streams:
        """A new connection to ``worker_id``; `OSError` if it cannot be reached."""

    async def reachable(self, worker_id: str) -> bool:
        """Whether ``worker_id`` accepts connections."""

    async def worker_ids(self) -> list[str]:
        """Every worker that may be reached (some may turn out gone)."""


class UnixEndpoints:
    """Private Unix sockets in the server's runtime directory."""

    def __init__(self, runtime_dir: RuntimeDirectory) -> None:
        self.runtime_dir = runtime_dir
        self.socket_path = runtime_dir.socket_path

    async def worker_ids(self) -> list[str]:
        return self.runtime_dir.worker_ids()

    async def open(self, worker_id: str) -> Streams:
        return await asyncio.open_unix_connection(self.socket_path(worker_id), limit=_READ_LIMIT)

    async def reachable(self, worker_id: str) -> bool:
        return await _accepts(self.open(worker_id))


class TcpEndpoints:
    """Private TCP listeners at the addresses workers registered in Redis."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.registry = registry

    async def worker_ids(self) -> list[str]:
        return await self.registry.worker_ids()

    async def open(self, worker_id: str) -> Streams:
        address = await self.registry.lookup(worker_id)
        if address is None:
            raise ConnectionRefusedError(f"worker {worker_id} is not registered")
        host, port = address
        async with asyncio.timeout(_TCP_CONNECT_SECONDS):
            reader, writer = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
        _keep_alive(writer.get_extra_info("socket"))
        return reader, writer

    async def reachable(self, worker_id: str) -> bool:
        return await _accepts(self.open(worker_id))


def _keep_alive(sock: socket.socket | None) -> None:
    # A host that vanishes mid-request sends nothing, not even a reset: probe
    # idle connections so the wait ends in seconds, not in TCP's many minutes.
    # (No read timeout: a step may legitimately take long.)
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in _KEEPALIVE_PROBES:
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


async def _accepts(opening: object) -> bool:
    """False if the worker is gone (refused, unregistered); True if it accepts or is slow."""
    try:
        _, writer = await opening  # type: ignore[misc]
    except TimeoutError:
        return True  # not known to be gone: the caller answers 502, not 410
    except OSError as exc:
        return out_of_resources(exc)  # our shortage says nothing about the worker
    writer.close()
    return True
