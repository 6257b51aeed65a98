"""The reply headers that tell a pooling client which worker reads a connection.

On a server that routes sessions (more than one worker, routing on), every
reply a worker's app produces carries `HOLDER_HEADER` with the worker's id
(the session's holder); a reply relayed
from the holder also carries `RELAYED_BY_HEADER` with the relaying worker's id,
because the client's connection stays with that worker. A client that keeps a
connection per worker (`gym_sessions.client.connection_pool`) sends each
session's requests on its holder's connection, and none of them hops.

The headers are hints, never credentials: every request is still routed by
its cookie or key, a client that ignores them is served as before, and a wrong
hint (a proxy between, a session that moved) costs a hop, never a wrong
session (docs/design.md §3.4.8). Worker ids are public already (``/health``,
step batch results).
"""

from __future__ import annotations

from gym_sessions.wire import HOLDER_HEADER, RELAYED_BY_HEADER

__all__ = ["holder_hint", "relayed_by_hint"]


def holder_hint(worker_id: str) -> tuple[bytes, bytes]:
    """The header naming ``worker_id`` as the worker that served a reply."""
    return HOLDER_HEADER.encode(), worker_id.encode()


def relayed_by_hint(worker_id: str) -> tuple[bytes, bytes]:
    """The header naming ``worker_id`` as the worker that relayed a reply."""
    return RELAYED_BY_HEADER.encode(), worker_id.encode()
