"""The hop: hand a request to the worker that claims its session, and its reply back.

The request goes to the holder unchanged (method, raw path, query, headers
less hop-by-hop ones, ``content-length`` set anew, the body already read) and
the reply streams back unchanged. `StreamForwarder` implements `Forwarder`:
plain HTTP/1.1 written and parsed by hand on a pool of persistent connections
per holder to its private uvicorn listener (``<runtime dir>/workers/<id>.sock``
with file claims, a TCP port with Redis claims).

An aiohttp client per holder measured slower and was removed (see
``benchmarks/README.md``). Another design, handing the ASGI scope and body
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

from typing import TYPE_CHECKING, Protocol

from starlette.types import Scope, Send

from gym_sessions.errors import SessionGoneError

if TYPE_CHECKING:
    from gym_sessions.routing.forward_signature import ForwardSigner
    from gym_sessions.routing.worker_endpoints import WorkerEndpoints

__all__ = [
    "HELD_MARK",
    "HOP_BY_HOP_HEADERS",
    "HOP_MARKS_KEY",
    "NOT_HELD_HEADER",
    "PLACED_MARK",
    "SIGNATURE_HEADER",
    "Forwarder",
    "HolderRefusedError",
    "forwarded_headers",
    "holder_gone",
    "holder_refused",
    "hop_marks",
    "make_forwarder",
    "received_mark",
    "reply_headers",
    "request_target",
]

HOP_BY_HOP_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
# The body travels whole, so its length is set anew, the accepting worker
# already answered any ``Expect: 100-continue``, and only the forwarding worker
# may sign a request for a private listener.
SIGNATURE_HEADER = b"x-gym-forward-signature"
# Hop marks: what the forwarding worker tells the receiving one about this hop
# (the router sets them in the scope under `HOP_MARKS_KEY`; they travel after
# the request's own headers and, on TCP, under the signature). A client's own
# header of such a name never passes a hop, so only a peer worker sets one.
#: ``<load>``: a start placed here because the sender saw this worker at
#: ``<load>`` sessions; refuse it (no-room mark) if this worker holds clearly more.
PLACED_MARK = b"x-gym-hop-placed"
#: ``1``: sent on a cached holder lookup; refuse (`NOT_HELD_HEADER`) unless this
#: worker holds the session, never claim or serve it.
HELD_MARK = b"x-gym-hop-held"
_MARKS = frozenset({PLACED_MARK, HELD_MARK})
#: On a private reply: this worker does not hold the session a `HELD_MARK` named.
NOT_HELD_HEADER = b"x-gym-not-held"
HOP_MARKS_KEY = "gym_sessions.hop_marks"
_NOT_FORWARDED = HOP_BY_HOP_HEADERS | _MARKS | {b"content-length", b"expect", SIGNATURE_HEADER}


class Forwarder(Protocol):
    """Sends a request to another worker and streams its reply to ``send``."""

    async def forward(self, worker_id: str, scope: Scope, body: bytes, send: Send) -> None:
        """Forward; raises `SessionGoneError` when ``worker_id`` is gone."""

    async def close(self) -> None:
        """Close every connection."""


def request_target(scope: Scope) -> bytes:
    """The request's target as it arrived: raw path and query string."""
    target = scope.get("raw_path") or scope["path"].encode()
    query = scope.get("query_string")
    return target + b"?" + query if query else target


def forwarded_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers without hop-by-hop ones and without its length."""
    return [(name, value) for name, value in scope["headers"] if name not in _NOT_FORWARDED]


def hop_marks(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The marks the forwarding worker sends with this hop (set in ``scope[HOP_MARKS_KEY]``)."""
    return list(scope.get(HOP_MARKS_KEY, ()))


def received_marks(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The hop marks a request that arrived over a private listener carries."""
    return [(name, value) for name, value in scope["headers"] if name in _MARKS]


def received_mark(scope: Scope, name: bytes) -> bytes | None:
    """The value of hop mark ``name`` on a request that arrived privately, or ``None``."""
    for header, value in scope["headers"]:
        if header == name:
            return value
    return None


def reply_headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A holder's reply headers, lower-cased, without hop-by-hop ones."""
    lowered = ((name.lower(), value) for name, value in raw)
    return [(name, value) for name, value in lowered if name not in HOP_BY_HOP_HEADERS]


class HolderRefusedError(SessionGoneError):
    """The holder refused the connection: the request never reached it (410 as any gone holder).

    Unlike a hop that broke mid-request, nothing can have run there, so a
    durable session may be restored elsewhere and this very request served.
    """


def holder_gone(worker_id: str) -> SessionGoneError:
    """The error for a session whose worker has exited."""
    return SessionGoneError(f"the worker that holds this session ({worker_id}) is gone")


def holder_refused(worker_id: str) -> HolderRefusedError:
    """`holder_gone` for a holder that refused the connection before any byte was sent."""
    return HolderRefusedError(f"the worker that holds this session ({worker_id}) is gone")


def make_forwarder(endpoints: WorkerEndpoints, signer: ForwardSigner | None = None) -> Forwarder:
    """The hop to the workers ``endpoints`` name; ``signer`` signs every forwarded
    request (private listeners on TCP)."""
    from gym_sessions.routing.stream_forwarder import StreamForwarder

    return StreamForwarder(endpoints, signer)
