"""The hop: hand a request to the worker that claims its session, and its reply back.

The request goes to the holder unchanged (method, raw path, query, headers
less hop-by-hop ones, ``content-length`` set anew, the body already read) and
the reply streams back unchanged (which headers travel: `hop_headers`).
`StreamForwarder` implements `Forwarder`: plain HTTP/1.1 written and parsed
by hand on a pool of persistent connections per holder to its private uvicorn
listener (``<runtime dir>/workers/<id>.sock`` with file claims, a TCP port
with Redis claims).

An aiohttp client per holder measured slower and was removed (see
``benchmarks/LOG.md``). Another design, handing the ASGI scope and body
over as frames without HTTP on either side, measured 0.97-1.02x this hop's
latency (commit "Experiment: a framed ASGI hop";
``benchmarks/results/routing_cost.json``): the HTTP parsing it skips is
already C (httptools), so it was removed too.

Every routed worker listens on its HTTP private socket, which stays usable for
debugging:
``curl --unix-socket <runtime dir>/workers/<id>.sock http://worker/health``. A
holder whose socket refuses connections or is gone is gone:
`SessionGoneError` (410).
"""

from __future__ import annotations

from typing import Protocol

from starlette.types import Scope, Send

from gym_sessions.errors import BadGatewayError, HTTPError, SessionGoneError

__all__ = [
    "Forwarder",
    "HolderRefusedError",
    "holder_gone",
    "holder_refused",
    "hop_error",
]


class Forwarder(Protocol):
    """Sends a request to another worker and streams its reply to ``send``."""

    async def forward(self, worker_id: str, scope: Scope, body: bytes, send: Send) -> None:
        """Forward; raises `SessionGoneError` when ``worker_id`` is gone."""

    async def close(self) -> None:
        """Close every connection."""


class HolderRefusedError(SessionGoneError):
    """The holder refused the connection: the request never reached it (410 as any gone holder).

    Unlike a hop that broke mid-request, nothing can have run there, so a
    durable session may be restored elsewhere and this very request served.
    """


def holder_gone(worker_id: str) -> SessionGoneError:
    """The error for a session whose worker has exited."""
    return SessionGoneError(f"the worker that holds this session ({worker_id}) is gone")


def hop_error(error: HTTPError, worker_id: str, *, durable: bool) -> HTTPError:
    """What a client gets for a hop to ``worker_id`` that failed with ``error``.

    With durable sessions a holder that died with the request sent to it (it
    may have run there) is a 502, not a 410: the session is not gone, its next
    request restores it. (One that refused the connection is taken over at
    once instead: `HolderRefusedError`, never passed here.)
    """
    if durable and type(error) is SessionGoneError:
        return BadGatewayError(
            f"the worker that held this session ({worker_id}) exited while serving this"
            " request, which may have run; the session's next request restores it"
        )
    return error


def holder_refused(worker_id: str) -> HolderRefusedError:
    """`holder_gone` for a holder that refused the connection before any byte was sent."""
    return HolderRefusedError(f"the worker that holds this session ({worker_id}) is gone")
