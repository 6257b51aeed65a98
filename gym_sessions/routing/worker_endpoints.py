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
import ipaddress
import socket
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from gym_sessions.errors import ClaimsUnavailableError, out_of_resources
from gym_sessions.runtime_dir import worker_process_exists

if TYPE_CHECKING:
    from gym_sessions.routing.redis_registry import WorkerRegistry
    from gym_sessions.runtime_dir import RuntimeDirectory

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
        if not worker_process_exists(worker_id):
            # A killed worker's socket may still accept while the kernel tears
            # it down, but nothing sent to it can run: refuse, as its exit will.
            raise ConnectionRefusedError(f"worker {worker_id} has exited")
        return await asyncio.open_unix_connection(self.socket_path(worker_id), limit=_READ_LIMIT)

    async def reachable(self, worker_id: str) -> bool:
        return await _accepts(self.open(worker_id))


class TcpEndpoints:
    """Private TCP listeners at the addresses workers registered in Redis.

    Args:
        registry: Worker registrations.
        peer_networks: The only networks forwarded requests may go to: an
            address outside them (a registration rewritten by whoever can write
            Redis) gets 503, never a connection.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        peer_networks: Sequence[ipaddress.IPv4Network | ipaddress.IPv6Network] = (),
    ) -> None:
        self.registry = registry
        self.peer_networks = tuple(peer_networks)

    async def worker_ids(self) -> list[str]:
        return await self.registry.worker_ids()

    async def open(self, worker_id: str) -> Streams:
        address = await self.registry.lookup(worker_id)
        if address is None:
            await self._gone_or_slow(worker_id)
            raise ConnectionRefusedError(f"worker {worker_id} is not registered")
        return await self._connect(worker_id, address)

    async def _connect(self, worker_id: str, address: tuple[str, int]) -> Streams:
        host, port = address
        if not self._allowed(host):
            raise ClaimsUnavailableError(
                f"worker {worker_id} is registered at {host}, outside --peer-network: "
                "not forwarding there"
            )
        async with asyncio.timeout(_TCP_CONNECT_SECONDS):
            reader, writer = await asyncio.open_connection(host, port, limit=_READ_LIMIT)
        _keep_alive(writer.get_extra_info("socket"))
        return reader, writer

    async def _gone_or_slow(self, worker_id: str) -> None:
        """An unregistered worker is gone only if the address its claims name refuses.

        A worker whose heartbeat could not renew in time (a Redis stall, a lost
        reply) but that still listens is slow, not gone: 503, so its sessions
        never get a 410 they would later contradict.
        """
        claimed = self.registry.claimed_address(worker_id)
        if claimed is None or not self._allowed(claimed[0]):
            return
        try:
            _, writer = await self._connect(worker_id, claimed)
        except (OSError, TimeoutError):
            return  # refused or silent: gone (the caller answers 410)
        writer.close()
        await self.registry.eviction.refuse_if_evicting()  # evicted, maybe: then say so
        raise ClaimsUnavailableError(
            f"worker {worker_id}'s registration lapsed but it still listens: slow, not gone; "
            "retry shortly"
        )

    def _allowed(self, host: str) -> bool:
        if not self.peer_networks:
            return True
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # registrations hold addresses, never names
        return any(address in network for network in self.peer_networks)

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
