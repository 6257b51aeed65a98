"""Sessions whose env was never closed are closed at garbage collection or interpreter exit.

An env that is garbage-collected without ``close()``, or still open when the
interpreter exits (after a KeyboardInterrupt, say), closes its session on the
server: one ``POST /close_session`` with the session's key, over a new blocking
connection with a short timeout (`EXIT_CLOSE_TIMEOUT_SECONDS` for the connect and
again for the reply), best effort and never raising. Then its own connection is
released. ``weakref.finalize`` runs this once, at whichever comes first, and
`RemoteEnvProtocol.claim_close` makes sure a session that ``close()`` closed (or
is closing) is never closed again.

Why a blocking request and not an `AsyncRemoteEnv`'s own connection: at exit
its event loop may have closed (``asyncio.run`` closes it), and at garbage
collection the loop may be busy or run by another thread. A blocking request
works from anywhere; on a live server it takes about a millisecond. A
`RemoteVectorEnv` owns its loop's thread, so it closes its sub-envs on that loop
instead, all at once (`gym_sessions.client.vector_env`).
"""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable
from typing import Protocol

from gym_sessions.client.exchange import HTTPClientBase, Request
from gym_sessions.client.http import HTTPClient

__all__ = [
    "EXIT_CLOSE_TIMEOUT_SECONDS",
    "ClosableSession",
    "close_at_exit",
    "close_session_quietly",
]

#: Seconds to wait for the connect, and again for the reply, of a close at exit.
EXIT_CLOSE_TIMEOUT_SECONDS = 1.0


class ClosableSession(Protocol):
    """A client's session state: `RemoteEnvProtocol`, or the TRL adapter's session."""

    def claim_close(self) -> Request | None:
        """Mark the session closed; its close request the first time, if it started."""


def close_at_exit(
    env: object,
    http: HTTPClientBase,
    protocol: ClosableSession,
    release: Callable[[], None],
) -> weakref.finalize:
    """Close ``protocol``'s session and call ``release`` when ``env`` is collected or at exit.

    Args:
        env: The env whose life bounds the session (the finalizer holds no
            reference to it, only to ``http``, ``protocol`` and ``release``).
        http: The env's HTTP client: its URL, headers and session cookie.
        protocol: The env's protocol; its current session is the one closed.
        release: Frees the env's connection without raising (called after the close).

    Returns:
        The finalizer (calling it runs the close now, once).
    """
    return weakref.finalize(env, _close_abandoned, os.getpid(), http, protocol, release)


def _close_abandoned(
    pid: int, http: HTTPClientBase, protocol: ClosableSession, release: Callable[[], None]
) -> None:
    if os.getpid() != pid:
        return  # a forked child holds a copy of its parent's env: not its session to close
    with contextlib.suppress(Exception):  # best effort: a dead server must not spoil exit
        close_session_quietly(http, protocol)
    with contextlib.suppress(Exception):
        release()


def close_session_quietly(http: HTTPClientBase, protocol: ClosableSession) -> None:
    """Close the session over a new blocking connection with a short timeout, unless already closed.

    Raises:
        GymSessionsError: the close failed (callers at exit suppress it).
    """
    request = protocol.claim_close()
    if request is None:
        return
    client = HTTPClient(
        http.url,
        timeout=EXIT_CLOSE_TIMEOUT_SECONDS,
        keep_alive=False,
        retries=0,
        cookie_name=http.cookie_name,
        headers=http.headers,
        ssl_context=http.ssl_context,
    )
    client.cookie = http.cookie
    try:
        client.send(request)
    finally:
        client.close()
