"""The ASGI scope keys one part of a worker sets and another reads.

The listeners (`gym_sessions.transport`) mark what they know about a
connection, the router (`gym_sessions.routing`) what it did with a request,
and the metrics (`gym_sessions.metrics`) read both. Kept here, in a module
that imports nothing of the package, so none of them imports another to learn
a key.
"""

from __future__ import annotations

import enum

__all__ = [
    "CONNECTION_SCOPE_KEY",
    "GIVEN_AWAY_SCOPE_KEY",
    "HANDED_IN_SCOPE_KEY",
    "PRIVATE_SCOPE_KEY",
    "SERVED_SCOPE_KEY",
    "STARTS_HERE_SCOPE_KEY",
    "Served",
]

#: In every request's scope on a public listener: the `BoundedHttpProtocol` that received it.
CONNECTION_SCOPE_KEY = "gym_sessions.connection"
#: In the scope of a request replayed on a connection handed to this worker:
#: the id of the worker that handed it over.
HANDED_IN_SCOPE_KEY = "gym_sessions.handed_in"
#: In the scope of a request whose connection this worker gave away (nothing is
#: counted here: the holder counts the request it served).
GIVEN_AWAY_SCOPE_KEY = "gym_sessions.given_away"
#: ``True`` in the scope of a request that arrived over a private listener.
PRIVATE_SCOPE_KEY = "gym_sessions.private"
#: ``True`` in the scope of a request that a WebSocket on this worker carries: a
#: session it starts is started here (no balanced placement), where its messages arrive.
STARTS_HERE_SCOPE_KEY = "gym_sessions.starts_here"
#: Where the reply to a public request came from (a `Served`; absent means `Served.LOCAL`).
SERVED_SCOPE_KEY = "gym_sessions.served"


class Served(enum.Enum):
    """Where the reply to a request accepted on the public listener came from.

    The router records it in the request's scope (`SERVED_SCOPE_KEY`; absent
    means `LOCAL`) for the operator metrics (`gym_sessions.metrics`).
    """

    #: This worker's app, or this worker's own error reply (410 for a gone holder included).
    LOCAL = "local"
    #: Another worker, over its private listener (§3.10).
    FORWARDED = "forwarded"
    #: This worker's app, for a request whose connection another worker handed
    #: here (`gym_sessions.routing.handoff`); counted here, not by that worker.
    HANDED_OVER = "handed_over"
