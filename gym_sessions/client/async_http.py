"""The asyncio HTTP shell of the clients: one kept-alive HTTP/1.1 connection per session.

Every request of a session goes over the connection that started it
(`gym_sessions.client.http11`: asyncio, one request at a time), and reaches
the worker that claimed the session, with no routing hop. If that connection
closes, the next one carries the session cookie and the server routes it to
the holder. No cookie jar: the session cookie is kept by hand
(`HTTPClientBase`), as in the blocking client, so that sessions sharing a host
never see each other's cookie. Many sessions may share connections instead
(``pool=``): a `ConnectionPool` sends each request on its session's holder's
connection (`gym_sessions.client.connection_pool`; the agent server's env
sessions use one per env server), with its timeout and ``https`` settings.

Like the blocking shell, this module only moves bytes and names how a send
failed; the rules are `gym_sessions.client.exchange`'s and
`gym_sessions.client.step_recovery`'s.

`AsyncHTTPClient.close_soon` closes the connection without ``await``, from
any thread, even after its event loop has closed: an env collected or still
open at interpreter exit leaves no socket and no "Unclosed" warning behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Mapping

from gym_sessions.client.connection_pool import ConnectionPool
from gym_sessions.client.exchange import (
    Exchange,
    HTTPClientBase,
    Reply,
    Request,
    TransportFailure,
)
from gym_sessions.client.http11 import Http11Connection
from gym_sessions.client.step_recovery import StepRecovery
from gym_sessions.wire import SESSION_COOKIE

__all__ = ["AsyncHTTPClient"]

#: Seconds `AsyncHTTPClient.close_soon` waits for a loop in another thread.
_CLOSE_SOON_SECONDS = 1.0


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class AsyncHTTPClient(HTTPClientBase):
    """``await send(request)`` over one kept-alive connection (see `HTTPClientBase`).

    The connection (`Http11Connection`) is opened on first use, inside the
    running event loop, and belongs to that loop; with ``pool=`` the requests
    go through that pool's connections instead.

    Args:
        url: As for `HTTPClientBase`.
        timeout: As for `HTTPClientBase`.
        keep_alive: As for `HTTPClientBase`.
        retries: As for `HTTPClientBase`.
        cookie_name: As for `HTTPClientBase`.
        headers: As for `HTTPClientBase`.
        ssl_context: As for `HTTPClientBase`.
        pool: A `ConnectionPool` of the same origin shared with other
            sessions, which `close` leaves open: its ``timeout`` and TLS
            settings apply (not ``timeout`` nor ``ssl_context``).

    Raises:
        ValueError: as for `HTTPClientBase`, or a pool of another origin.
    """

    _connection: Http11Connection | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        keep_alive: bool = True,
        retries: int = 1,
        cookie_name: str = SESSION_COOKIE,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        pool: ConnectionPool | None = None,
    ) -> None:
        if pool is not None:
            timeout, ssl_context = pool.timeout, pool.ssl_context
        super().__init__(
            url,
            timeout=timeout,
            keep_alive=keep_alive,
            retries=retries,
            cookie_name=cookie_name,
            headers=headers,
            ssl_context=ssl_context,
        )
        self._pool = pool
        #: The worker holding this client's session, as its last reply named it.
        self.holder: str | None = None
        if pool is not None:
            scheme = "https" if self.ssl_context is not None else "http"
            if not pool.serves(scheme, self._host, self._port):
                raise ValueError(f"the pool is for {pool.url}, not {url}")
            if pool.max_reply_bytes is not None:
                self.max_decompressed_reply = pool.max_reply_bytes  # after decompression too

    def _connected(self) -> Http11Connection:
        loop = asyncio.get_running_loop()
        if self._connection is None or self._loop is not loop:
            if self._connection is not None:
                self._connection.close()  # of another (finished) loop
            self._connection = Http11Connection(
                self._host,
                self._port,
                timeout=self.timeout,
                keep_alive=self.keep_alive,
                ssl_context=self.ssl_context,
            )
            self._loop = loop
        return self._connection

    async def send(self, request: Request, *, over: AsyncHTTPClient | None = None) -> Reply:
        """Send ``request``; returns its reply.

        ``over``: send it over that client's connection (same URL), with this
        client's cookie and headers, and keep the cookie its reply sets here.

        Raises:
            ServerUnreachableError: the server cannot be reached.
            HTTPError: the server replied with an error (the matching subclass).
            ConnectionLostError: the reply was lost and the request is not resendable.
            ReplyTimeoutError: no reply in time.
        """
        exchange = self.exchange(request)
        shell = over or self
        while True:
            try:
                status, headers, body = await shell._round_trip(exchange, self)
                return exchange.replied(status, headers, body)
            except TransportFailure as failure:
                exchange.failed(failure)  # returns only to send again

    async def send_step(self, step: StepRecovery) -> Reply:
        """Send a step's requests until its reply is in (errors as for `send`)."""
        return await step.drive_async(self.send)

    async def _round_trip(
        self, exchange: Exchange, sender: AsyncHTTPClient
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        """One send of ``exchange`` over this client's connection or pool, for ``sender``."""
        target = self._prefix + exchange.path
        if self._pool is None:
            connection = self._connected()
            return await connection.round_trip(
                exchange.method, target, exchange.headers, exchange.payload
            )
        # A session's first start over another's connection (a vector env's
        # group) asks for that session's worker: it starts beside it.
        reply, sender.holder = await self._pool.round_trip(
            sender.holder or self.holder,
            exchange.method,
            target,
            exchange.headers,
            exchange.payload,
        )
        return reply

    async def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()
            await asyncio.sleep(0)  # lets the transport finish closing its socket

    def close_soon(self) -> None:
        """Close the connection without ``await``, from any thread; never raises.

        For garbage collection and interpreter exit. A loop running in another
        thread closes it (waited for up to a second); a loop that is not running
        is run once to close it; a loop that has closed cannot, so the socket
        is shut down at once (the server sees the connection end).
        """
        connection, loop = self._connection, self._loop
        self._connection = None
        if connection is None or loop is None:
            return
        with contextlib.suppress(Exception):
            here = _running_loop()
            if loop.is_closed():
                connection.shut_down()
            elif loop is here:
                connection.close()
            elif loop.is_running():
                closing = asyncio.run_coroutine_threadsafe(_close(connection), loop)
                closing.result(_CLOSE_SOON_SECONDS)
            elif here is None:
                loop.run_until_complete(_close(connection))
            else:
                connection.shut_down()


async def _close(connection: Http11Connection) -> None:
    connection.close()
    await asyncio.sleep(0)
