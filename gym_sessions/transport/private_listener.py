"""Each worker's private listener, over which other workers forward requests.

A Unix socket in the runtime directory (file claims, one host), or a TCP port
on ``private_host`` (Redis claims, several hosts), whose requests the router
admits only with a valid forward signature (`ForwardSigner`).

It serves the worker's own app on the worker's own event loop, started after the
app's startup. It is not a `uvicorn.Server`: ``Server.serve()`` installs signal
handlers and a ``Config`` with defaults reconfigures process-wide logging, and
both belong to the worker. Only uvicorn's HTTP protocol is reused, configured
without lifespan, date or server headers, proxy-header rewriting or access lines.
Requests that arrive here are marked, so the router handles them where they
arrive and never forwards twice.

Bounded like the public listeners, whatever the worker's own uvicorn config
says: request heads go through `BoundedHttpProtocol` (431 and close as a head
crosses the public head limit plus `FORWARD_HEAD_ALLOWANCE`, before the router
ever sees it, so before the signature is checked; 408 or a silent close for a
head not complete within ``_HEAD_TIMEOUT_SECONDS``). On TCP, idle kept-alive
connections close after ``idle_timeout`` and at most ``max_connections`` are open at once
(`_ConnectionCap`), so a flood of connections to a private port cannot take the
descriptors the worker's public port, sessions and forwards need.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.server import ServerState

from gym_sessions.errors import OverloadedError
from gym_sessions.scope_keys import PRIVATE_SCOPE_KEY
from gym_sessions.transport.http_protocol import BoundedHttpProtocol

__all__ = [
    "DEFAULT_MAX_TCP_CONNECTIONS",
    "DEFAULT_TCP_IDLE_SECONDS",
    "FORWARD_HEAD_ALLOWANCE",
    "PrivateHttpProtocol",
    "PrivateListener",
]

logger = logging.getLogger("gym_sessions.routing")

# Forwarding clients pool connections for less than this, so the listener never
# closes a connection a client is about to reuse. On TCP (reachable from the
# network) idle connections go sooner: forwarders close theirs after 15 s idle
# (`stream_forwarder._IDLE_CLOSE_SECONDS`), and retry a pooled connection the
# listener closed while idle.
_KEEP_ALIVE_SECONDS = 3600
DEFAULT_TCP_IDLE_SECONDS = 60.0
# Room for what the hop adds to a head (the signature, ``content-length``): a
# head a public listener admitted at its limit still fits when forwarded. A
# larger one is refused as it crosses the limit, before the router (and so the
# signature check) sees it.
FORWARD_HEAD_ALLOWANCE = 4 * 1024
_MAX_HEAD_BYTES = 64 * 1024 + FORWARD_HEAD_ALLOWANCE
# Forwarders write a whole head in one go right after connecting: a head not
# complete this long after its first byte (or a connection silent this long) is
# not a forwarder's. As long as the public ``--header-timeout`` default, so a
# forwarder whose loop stalls between connecting and writing is not cut off sooner.
_HEAD_TIMEOUT_SECONDS = 30.0
# Open connections per TCP private listener (per worker), and never more than
# this share of the process's descriptor limit (the rest is the public port's,
# the sessions', Redis's and the outgoing forwards').
DEFAULT_MAX_TCP_CONNECTIONS = 256
_MAX_FD_SHARE = 4
# At most one warning about the cap per this many seconds (a flood would fill the log).
_CAP_WARNING_SECONDS = 10.0


class _MarkPrivate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[PRIVATE_SCOPE_KEY] = True
        await self.app(scope, receive, send)


def default_max_connections(limit: int = DEFAULT_MAX_TCP_CONNECTIONS) -> int:
    """``limit``, or a quarter of the soft ``RLIMIT_NOFILE`` when that is lower."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return limit
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return limit
    return max(1, min(limit, soft // _MAX_FD_SHARE))


class _ConnectionCap:
    """At most ``limit`` open connections; which one goes when a new one comes at the limit.

    A connection is *vouched for* once the app answered one of its requests with
    a status below 400: on a TCP private listener only a request with a valid
    forward signature gets that far (everything unsigned gets 403, oversized
    heads 431, unparsable ones uvicorn's 400), so only peer workers' connections
    are ever vouched for. At the limit a new connection is admitted in place of,
    in this order:

    1. the oldest connection not vouched for that is not being answered (a
       silent or half-sent one: a flood's; or a forwarder's that only ever got
       errors, which the forwarder reopens when it finds it closed);
    2. the vouched-for connection idle longest (a forwarder's pooled one: the
       forwarder finds it closed when it next takes it and retries afresh);

    and when every connection is in the middle of a request the new one is
    answered 503 ``overloaded`` and closed before anything is read from it.
    A flood of connections thus only ever pushes out its own connections (and
    never a request under way), while new peer connections still get in.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Insertion order is the eviction order: accepted-first, and
        # least-recently-answered-first.
        self._unvouched: dict[_PrivateProtocol, None] = {}
        self._vouched: dict[_PrivateProtocol, None] = {}
        self.evicted = 0
        self.refused = 0
        self._warned_at = float("-inf")
        self._unwarned = 0

    def __len__(self) -> int:
        return len(self._unvouched) + len(self._vouched)

    def admit(self, connection: _PrivateProtocol) -> bool:
        """Count ``connection`` in, closing another if at the limit; False: refuse it."""
        if len(self) >= self.limit:
            victim = self._victim()
            if victim is None:
                self.refused += 1
                self._warn()
                return False
            self.forget(victim)
            victim.evict()
            self.evicted += 1
            self._warn()
        self._unvouched[connection] = None
        return True

    def _victim(self) -> _PrivateProtocol | None:
        for connection in self._unvouched:
            if not connection.answering():
                return connection
        for connection in self._vouched:
            if connection.idle():
                return connection
        return None

    def vouch(self, connection: _PrivateProtocol) -> None:
        if connection in self._unvouched:
            del self._unvouched[connection]
            self._vouched[connection] = None

    def answered(self, connection: _PrivateProtocol) -> None:
        """A reply on ``connection`` is complete: most recently used goes last."""
        if connection in self._vouched:
            del self._vouched[connection]
            self._vouched[connection] = None

    def forget(self, connection: _PrivateProtocol) -> None:
        self._unvouched.pop(connection, None)
        self._vouched.pop(connection, None)

    def _warn(self) -> None:
        self._unwarned += 1
        now = time.monotonic()
        if now - self._warned_at >= _CAP_WARNING_SECONDS:
            logger.warning(
                "private listener at its limit of %d connections: %d connection(s) closed or "
                "refused since the last warning (%d closed, %d refused in all)",
                self.limit,
                self._unwarned,
                self.evicted,
                self.refused,
            )
            self._warned_at = now
            self._unwarned = 0


class _PrivateProtocol:
    """Mixed into `BoundedHttpProtocol` (`PrivateHttpProtocol`): no access lines, a cap."""

    # From BoundedHttpProtocol and uvicorn's protocol.
    app: Any
    transport: asyncio.Transport
    _head_bytes: int | None
    _replying: Any
    _refuse: Any

    def __init__(self, *args: Any, cap: _ConnectionCap | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The receiving worker already logs the request once.
        self.access_log = False
        self._cap = cap
        self._inner_app = self.app
        if cap is not None:
            self.app = self._vouching_app

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]  # a mixin: uvicorn's protocol
        if self._cap is not None and not self._cap.admit(self):
            self._refuse(
                OverloadedError(
                    f"this worker's private listener holds {self._cap.limit} busy connections"
                )
            )

    def connection_lost(self, exc: Exception | None) -> None:
        if self._cap is not None:
            self._cap.forget(self)
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self._cap is not None:
            self._cap.answered(self)

    async def _vouching_app(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_watched(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] < 400:
                # Past the signature check: this connection is a peer's.
                self.app = self._inner_app
                if self._cap is not None:
                    self._cap.vouch(self)
            await send(message)

        await self._inner_app(scope, receive, send_watched)

    def _unsupported_upgrade_warning(self) -> None:
        # uvicorn logs two warnings per request asking for an upgrade (none is
        # served here; the request goes on to the router like any other):
        # anyone who reaches the port could fill the log. Forwarders never ask.
        pass

    def answering(self) -> bool:
        """Whether a request's head is complete and its reply is not (a request under way)."""
        return self._replying()

    def idle(self) -> bool:
        """Whether the connection is between requests, with no byte of a next head."""
        return self._head_bytes == 0 and not self._replying()

    def evict(self) -> None:
        """Close at once, answering nothing (no request is under way)."""
        self.transport.close()


# uvicorn's connection_made takes the wider asyncio.BaseTransport; ours, as
# uvicorn's own, expects the socket transport every listener gives it.
class PrivateHttpProtocol(_PrivateProtocol, BoundedHttpProtocol):  # type: ignore[misc]
    """The private listeners' protocol: bounded heads, no access lines, a connection cap."""

    # A reply to a hop leaves as uvicorn writes it, head first: the
    # forwarding worker then wakes while this one still writes the body
    # (with one write, forwarded steps were 2% slower in an A/B run).
    coalesces_replies = False


class PrivateListener:
    """Serves ``app`` on the Unix socket at ``path`` (or TCP on ``host``) until `stop`.

    Args:
        app: The worker's ASGI app (the same object the public server runs).
        path: Socket path, inside the runtime directory's ``workers/``.
        host: Listen on TCP on this address instead, on a port the system picks
            (`address` tells which, once started).
        private: Mark requests as arrived over a private socket. Tests turn it
            off to give in-process workers a public listener of their own.
        max_head_bytes: Request heads larger than this get 431 as they cross it.
        max_connections: Open connections at most (see `_ConnectionCap`); on
            TCP never more than a quarter of the descriptor limit
            (`default_max_connections`). No limit on a Unix socket by default
            (reachable by this user's processes only).
        idle_timeout: Seconds an idle TCP connection stays open (a Unix
            socket's stay open as long as forwarders pool them).
    """

    def __init__(
        self,
        app: ASGIApp,
        path: str | None = None,
        *,
        host: str | None = None,
        private: bool = True,
        max_head_bytes: int | None = None,
        max_connections: int | None = None,
        idle_timeout: float = DEFAULT_TCP_IDLE_SECONDS,
    ) -> None:
        if (path is None) == (host is None):
            raise ValueError("a private listener needs a socket path or a host, not both")
        self.path = path
        self.host = host
        self.address: tuple[str, int] | None = None
        self._config = uvicorn.Config(
            _MarkPrivate(app) if private else app,
            uds=path,
            http=PrivateHttpProtocol,
            lifespan="off",
            log_config=None,
            log_level=None,
            access_log=True,  # False would strip handlers from the process-wide logger
            proxy_headers=False,
            server_header=False,
            date_header=False,
            # uvicorn types it int but only ever passes it to loop.call_later.
            timeout_keep_alive=_KEEP_ALIVE_SECONDS if path is not None else idle_timeout,  # type: ignore[arg-type]
            ws="none",
        )
        self._config.load()
        self._max_head_bytes = _MAX_HEAD_BYTES if max_head_bytes is None else max_head_bytes
        self._head_timeout = _HEAD_TIMEOUT_SECONDS
        if host is not None:
            max_connections = default_max_connections(
                DEFAULT_MAX_TCP_CONNECTIONS if max_connections is None else max_connections
            )
        self.connections = _ConnectionCap(max_connections) if max_connections else None
        self._state = ServerState()
        self._server: asyncio.base_events.Server | None = None
        #: Makes this listener's protocol for one connection (once started).
        self.new_protocol: Any = None

    async def start(self) -> None:
        """Start listening."""
        config, state, cap = self._config, self._state, self.connections
        max_head_bytes, head_timeout = self._max_head_bytes, self._head_timeout
        protocol_class: Any = self._config.http_protocol_class  # `PrivateHttpProtocol`
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            return protocol_class(
                config=config,
                server_state=state,
                app_state={},
                max_head_bytes=max_head_bytes,
                head_timeout=head_timeout,
                cap=cap,
            )

        self.new_protocol = protocol

        if self.path is not None:
            self._server = await loop.create_unix_server(
                protocol, path=self.path, backlog=config.backlog
            )
            os.chmod(self.path, 0o600)
        else:
            # The backlog is also how many connections asyncio accepts in one go
            # (each a descriptor until the cap closes it): no more than the cap.
            backlog = min(config.backlog, cap.limit) if cap is not None else config.backlog
            self._server = await loop.create_server(
                protocol, host=self.host, port=0, backlog=backlog
            )
            self.address = self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        """Stop listening, let open requests finish briefly, and remove the socket."""
        if self._server is None:
            return
        self._server.close()
        for connection in list(self._state.connections):
            connection.shutdown()
        for _ in range(50):
            if not self._state.tasks:
                break
            await asyncio.sleep(0.02)
        self._server = None
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
