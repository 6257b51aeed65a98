"""The asyncio HTTP shell of the clients: aiohttp with one kept-alive connection per session.

The connector holds at most one connection (``limit=1``), so every request of a
session goes over the connection that started it and reaches the worker that
claimed the session, with no routing hop. If that connection closes, the next
one carries the session cookie and the server routes it to the holder. No
cookie jar: the session cookie is kept by hand (`HTTPClientBase`), as in the
blocking client, so that sessions sharing a host never see each other's cookie.
A server that holds many sessions of its own (the agent) passes its pool
instead (``pool=``): the requests share its connections and its timeouts.

Like the blocking shell, this module only moves bytes and names how a send
failed; the rules are `gym_sessions.client.exchange`'s and
`gym_sessions.client.step_recovery`'s.

`AsyncHTTPClient.close_soon` closes the aiohttp session without ``await``, from
any thread, even after its event loop has closed: an env collected or still
open at interpreter exit must not leave aiohttp's "Unclosed client session"
message behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Coroutine, Iterator, Mapping
from typing import Any

import aiohttp

from gym_sessions.client.exchange import (
    Exchange,
    Failure,
    HTTPClientBase,
    Reply,
    Request,
    TransportFailure,
)
from gym_sessions.client.step_recovery import StepRecovery
from gym_sessions.errors import GymSessionsError
from gym_sessions.wire import SESSION_COOKIE

__all__ = ["AsyncHTTPClient"]

# The client drops an idle connection before the server would (its keep-alive
# is 120 s), so a kept-alive connection is never reused half-closed.
_IDLE_SECONDS = 60.0

#: Seconds `AsyncHTTPClient.close_soon` waits for a loop in another thread.
_CLOSE_SOON_SECONDS = 1.0


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _run_without_loop(coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run ``coroutine`` up to its first suspension, then drop it.

    Closing an aiohttp session closes its sockets (or, once its loop has
    closed, just marks it closed) before it first suspends; what follows only
    waits for the sockets to finish closing, which a closed or busy loop cannot do.
    """
    try:
        coroutine.send(None)
    except StopIteration:
        return
    coroutine.close()


@contextlib.contextmanager
def _send_failures() -> Iterator[None]:
    """Report aiohttp's errors of a send as `TransportFailure`."""
    try:
        yield
    except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
        raise TransportFailure(Failure.UNREACHABLE, str(exc)) from exc
    except TimeoutError as exc:
        raise TransportFailure.of(Failure.TIMEOUT, exc) from exc
    except aiohttp.ClientError as exc:
        raise TransportFailure.of(Failure.LOST, exc) from exc


class AsyncHTTPClient(HTTPClientBase):
    """``await send(request)`` over one kept-alive connection (see `HTTPClientBase`).

    The aiohttp session is made on first use, inside the running event loop,
    and belongs to that loop.

    Args:
        url: As for `HTTPClientBase`; ``https`` too with a ``pool``.
        timeout: As for `HTTPClientBase`.
        keep_alive: As for `HTTPClientBase`.
        retries: As for `HTTPClientBase`.
        cookie_name: As for `HTTPClientBase`.
        headers: As for `HTTPClientBase`.
        pool: A shared aiohttp session to send with, which `close` leaves open:
            its connector, timeouts and TLS settings apply (not ``timeout``);
            its cookie jar is not used.
    """

    _session: aiohttp.ClientSession | None = None
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
        pool: aiohttp.ClientSession | None = None,
    ) -> None:
        schemes: tuple[str, ...] = ("http",)
        if pool is not None:
            schemes = ("http", "https")
            # ReplyTimeoutError names the wait the pool allows for a reply.
            timeout = pool.timeout.sock_read or pool.timeout.total or math.inf
        super().__init__(
            url,
            timeout=timeout,
            keep_alive=keep_alive,
            retries=retries,
            cookie_name=cookie_name,
            headers=headers,
            schemes=schemes,
        )
        self._pool = pool

    def _client(self) -> aiohttp.ClientSession:
        if self._pool is not None:
            return self._pool
        if self._session is None or self._session.closed:
            if self.keep_alive:
                connector = aiohttp.TCPConnector(limit=1, keepalive_timeout=_IDLE_SECONDS)
            else:  # aiohttp refuses an idle timeout for connections it never keeps
                connector = aiohttp.TCPConnector(limit=1, force_close=True)
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                auto_decompress=False,
            )
        return self._session

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
                status, headers, body = await shell._round_trip(exchange)
            except TransportFailure as failure:
                exchange.failed(failure)  # returns only to send again
            else:
                return exchange.replied(status, headers, body)

    async def send_step(self, step: StepRecovery) -> Reply:
        """Send a step's requests until its reply is in (errors as for `send`)."""
        while step.request is not None:
            try:
                reply = await self.send(step.request)
            except GymSessionsError as error:
                step.failed(error)  # returns only if there is a request to send next
            else:
                step.replied(reply)
        return step.reply

    async def _round_trip(self, exchange: Exchange) -> tuple[int, list[tuple[str, str]], bytes]:
        url = self.url + exchange.path
        with _send_failures():
            async with self._client().request(
                exchange.method, url, data=exchange.payload or None, headers=exchange.headers
            ) as response:
                return response.status, list(response.headers.items()), await response.read()

    async def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def close_soon(self) -> None:
        """Close the connection without ``await``, from any thread; never raises.

        For garbage collection and interpreter exit. A loop running in another
        thread closes it (waited for up to a second); a loop that is not running
        is run to close it; otherwise (the loop has closed, or runs this very
        code) the sockets are closed at once without waiting for them.
        """
        session, loop = self._session, self._loop
        self._session = None
        if session is None or loop is None or session.closed:
            return
        with contextlib.suppress(Exception):
            here = _running_loop()
            if loop.is_closed() or loop is here:
                _run_without_loop(session.close())
            elif loop.is_running():
                closing = asyncio.run_coroutine_threadsafe(session.close(), loop)
                closing.result(_CLOSE_SOON_SECONDS)
            elif here is None:
                loop.run_until_complete(session.close())
            else:
                _run_without_loop(session.close())
