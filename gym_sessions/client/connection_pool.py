"""Connections to one server shared by many sessions, each request on its holder's connection.

A multi-worker server's workers share one listening socket, so a pooled
connection reaches whichever worker accepted it, and a request for another
worker's session costs a hop or a connection handoff on the server. Every
reply says which worker served it and which worker the connection now reaches
(`gym_sessions.wire.HOLDER_HEADER`, `RELAYED_BY_HEADER`): `ConnectionPool`
files each idle connection under the worker it reaches, and lends a session's
request the connection of that session's holder when one is idle. When the
holder has none, the request goes on a spare connection of another worker (one
that worker does not need: it has another idle), which a server with
connection handoff (its default on one host) moves to the holder for good;
where the server does not move it (no handoff, or another host), on a new
connection instead, which reaches whichever worker accepts it (a few misses in
a row and the pool stops trying for that holder: it may be another host's
worker, which no connection to this URL reaches). Either way the pool settles
with a connection on each holder it can reach, and from then on no request
hops.

The hints only choose a connection. Every request still carries its session
cookie and is routed by the server, so a wrong or missing hint (an HTTP proxy
in front, a session restored elsewhere, a server that sends none) costs a hop,
never a wrong reply. Which connection a request travels on never changes what
the exchange rules (`gym_sessions.client.exchange`) do with its reply.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import ssl
from urllib.parse import urlsplit

from gym_sessions.client.exchange import Failure, TransportFailure
from gym_sessions.client.http11 import Http11Connection, ReplyParts
from gym_sessions.client.tls import default_context
from gym_sessions.errors import RefusedReplyError
from gym_sessions.wire import HOLDER_HEADER, RELAYED_BY_HEADER

__all__ = ["ConnectionPool"]

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
#: New connections in a row that may miss a holder before the pool stops opening
#: more for it (at 4 workers and even accepts, 8 misses in a row: 1 in 10).
_MAX_MISSES = 8
_HOLDER = HOLDER_HEADER.lower()
_RELAYED_BY = RELAYED_BY_HEADER.lower()


class _Try(enum.Enum):
    """How a connection was chosen for a request."""

    IDLE = "an idle connection (the holder's, if it has one)"
    SPARE = "another worker's spare connection, for the server to move"
    NEW = "a new connection"


def _hints(headers: list[tuple[str, str]]) -> tuple[str | None, str | None]:
    """The worker that served a reply, and the worker its connection now reaches."""
    holder = relayed_by = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == _HOLDER:
            holder = value
        elif lowered == _RELAYED_BY:
            relayed_by = value
    return holder, relayed_by or holder


class ConnectionPool:
    """Kept-alive connections to the server at ``url``, filed by the worker each reaches.

    Pass it to `AsyncRemoteEnv` (``pool=``) to let many sessions share a few
    connections: each request goes on an idle connection of its session's
    holder if there is one, else on a spare connection of another worker for
    the server to move (see the module), else on a new connection while fewer
    than ``max_connections`` are open, else on any idle connection (the server
    routes it), else it waits for one (within ``timeout``). A redirect is
    refused, never followed (`RefusedReplyError`). A pool belongs to the event
    loop that first uses it; ``await close()`` when done.

    Example:
        >>> pool = ConnectionPool("http://127.0.0.1:8000")
        >>> envs = [await AsyncRemoteEnv.create(pool.url, pool=pool) for _ in range(40)]

    Args:
        url: The server's base URL (``http://host:port`` or ``https://host[:port]``;
            a path prefix is the clients' business).
        max_connections: At most this many connections open at once.
        timeout: Seconds for each reply, for a free connection, and for
            connecting unless ``connect_timeout`` says otherwise.
        ssl_context: TLS settings of an ``https://`` URL (the system's default
            by default).
        connect_timeout: Seconds for connecting (the TLS handshake included).
        max_reply_bytes: A reply body larger than this is refused
            (`RefusedReplyError`); ``None``: no bound.

    Raises:
        ValueError: a bad URL, or ``max_connections`` below 1.
    """

    def __init__(
        self,
        url: str,
        *,
        max_connections: int = 32,
        timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float | None = None,
        max_reply_bytes: int | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must look like http://host:port or https://host, not {url!r}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, not {max_connections}")
        self.url = url.rstrip("/")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.max_connections = max_connections
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.max_reply_bytes = max_reply_bytes
        self.ssl_context = (ssl_context or default_context()) if parts.scheme == "https" else None
        #: Idle connections by the worker each reaches (``None``: not known yet).
        self._idle: dict[str | None, list[Http11Connection]] = {}
        #: Every connection of the pool, idle or lent.
        self._members: set[Http11Connection] = set()
        #: Whether offering a spare connection to each holder moved it there last time.
        self._moves: dict[str, bool] = {}
        #: New connections in a row that did not reach each holder.
        self._misses: dict[str, int] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        """Connections the pool holds now, idle or lent."""
        return len(self._members)

    def idle_by_worker(self) -> dict[str | None, int]:
        """How many idle connections reach each worker (``None``: not known yet)."""
        return {worker: len(group) for worker, group in self._idle.items() if group}

    def serves(self, scheme: str, host: str, port: int) -> bool:
        """Whether requests for that origin may go through this pool."""
        return (scheme, host, port) == (self.scheme, self.host, self.port)

    async def round_trip(
        self,
        holder: str | None,
        method: str,
        target: str,
        headers: dict[str, str],
        body: bytes,
    ) -> tuple[ReplyParts, str | None]:
        """Send one request for a session held by ``holder`` (``None``: not known).

        Returns the reply and the session's holder as the reply names it
        (``holder`` again if it names none). Raises `TransportFailure` as
        `Http11Connection.round_trip` does.
        """
        connection, tried = await self._acquire(holder)
        reaches = None
        try:
            reply = await connection.round_trip(method, target, headers, body)
            served_by, reaches = _hints(reply[1])
        finally:
            self._release(connection, reaches)
        if holder is not None and tried is _Try.SPARE:
            # Whether this server moves a spare connection to a holder that asks.
            self._moves[holder] = reaches == holder
        elif holder is not None and tried is _Try.NEW:
            # A holder no new connection reaches (another host's worker, say) is
            # given up on after a few, so the pool does not grow to its bound.
            self._misses[holder] = 0 if reaches == holder else self._misses.get(holder, 0) + 1
        if reply[0] in _REDIRECTS:
            raise RefusedReplyError(f"the reply is a redirect ({reply[0]}), never followed")
        return reply, served_by or holder

    async def close(self) -> None:
        """Close every connection; lent ones close as they come back."""
        self._closed = True
        for group in self._idle.values():
            for connection in group:
                connection.close()
                self._members.discard(connection)
        self._idle.clear()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        await asyncio.sleep(0)  # lets the transports finish closing their sockets

    async def _acquire(self, holder: str | None) -> tuple[Http11Connection, _Try]:
        """A connection for a request of ``holder``'s session, and what was tried with it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._move_to(loop)
        deadline: float | None = None
        woken = False
        while True:
            if self._closed:
                raise TransportFailure(Failure.UNREACHABLE, "the connection pool is closed")
            if holder is None:
                # A session's first request may go anywhere: the server places it.
                idle = self._take_any()
                if idle is not None:
                    return idle, _Try.IDLE
            else:
                idle = self._take(holder) or self._take(None)
                if idle is not None:
                    return idle, _Try.IDLE
                if self._moves.get(holder, True):
                    # A worker's spare connection: with connection handoff (the
                    # server's default) the holder takes it over, and keeps it.
                    spare = self._take_spare()
                    if spare is not None:
                        return spare, _Try.SPARE
            room = len(self._members) < self.max_connections
            if room and (holder is None or self._misses.get(holder, 0) < _MAX_MISSES):
                # A new connection reaches whichever worker accepts it, and its
                # reply says which.
                return self._new_connection(), _Try.NEW
            idle = self._take_any()
            if idle is not None:
                return idle, _Try.IDLE
            if room:  # nothing idle: a holder given up on still gets a connection
                return self._new_connection(), _Try.NEW
            if deadline is None:
                deadline = loop.time() + self.timeout  # one bound for the whole wait
            waiter = loop.create_future()
            if woken:
                self._waiters.appendleft(waiter)  # taken from under it: first in line again
            else:
                self._waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as exc:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken but leaving: the turn passes on
                if isinstance(exc, TimeoutError):
                    raise TransportFailure(
                        Failure.TIMEOUT, "no pooled connection came free"
                    ) from exc
                raise
            woken = True

    def _new_connection(self) -> Http11Connection:
        connection = Http11Connection(
            self.host,
            self.port,
            timeout=self.timeout,
            ssl_context=self.ssl_context,
            connect_timeout=self.connect_timeout,
            max_reply_bytes=self.max_reply_bytes,
        )
        self._members.add(connection)
        return connection

    def _move_to(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start over on ``loop``: the connections of a finished loop cannot be used."""
        if self._loop is not None and not self._loop.is_closed() and self._loop.is_running():
            raise RuntimeError("a ConnectionPool is used from one event loop at a time")
        for connection in self._members:
            connection.shut_down()
        self._idle.clear()
        self._members.clear()
        self._waiters.clear()
        self._moves.clear()
        self._misses.clear()
        self._loop = loop

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def _take(self, worker: str | None) -> Http11Connection | None:
        group = self._idle.get(worker)
        return group.pop() if group else None

    def _take_spare(self) -> Http11Connection | None:
        # A worker's second idle connection or more: its sessions keep one.
        groups = [group for group in self._idle.values() if len(group) > 1]
        return max(groups, key=len).pop() if groups else None

    def _take_any(self) -> Http11Connection | None:
        # From the worker with the most idle connections: its sessions keep one.
        groups = [group for group in self._idle.values() if group]
        return max(groups, key=len).pop() if groups else None

    def _release(self, connection: Http11Connection, reaches: str | None) -> None:
        if self._closed or not connection.is_open or connection not in self._members:
            # Broken, ``Connection: close``, or of a closed pool: its slot frees up.
            connection.close()
            self._members.discard(connection)
        else:
            self._idle.setdefault(reaches, []).append(connection)
        self._wake_one()
