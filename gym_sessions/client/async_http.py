"""asyncio HTTP plumbing for the clients: aiohttp with one kept-alive connection per session.

The connector holds at most one connection (``limit=1``), so every request of a
session goes over the connection that started it and reaches the worker that
claimed the session, with no routing hop. If that connection closes, the next
one carries the session cookie and the server routes it to the claimant. No
cookie jar: the session cookie is kept by hand, as in the blocking client, so
that sessions sharing a host never see each other's cookie.

`AsyncHTTPClient.close_soon` closes the aiohttp session without ``await``, from
any thread, even after its event loop has closed: an env collected or still
open at interpreter exit must not leave aiohttp's "Unclosed client session"
message behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

import aiohttp

from gym_sessions.client.http import HTTPClientBase
from gym_sessions.client.protocol import Reply, Request
from gym_sessions.errors import ConnectionLostError, ReplyTimeoutError, ServerUnreachableError

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


class AsyncHTTPClient(HTTPClientBase):
    """``await send(request)`` over one kept-alive connection (see `HTTPClientBase`).

    The aiohttp session is made on first use, inside the running event loop,
    and belongs to that loop.
    """

    _session: aiohttp.ClientSession | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # aiohttp refuses an idle timeout for connections it never keeps.
            idle = {"keepalive_timeout": _IDLE_SECONDS} if self.keep_alive else {}
            connector = aiohttp.TCPConnector(limit=1, force_close=not self.keep_alive, **idle)
            self._loop = asyncio.get_running_loop()
            self._session = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                auto_decompress=False,
            )
        return self._session

    async def send(self, request: Request) -> Reply:
        """Send ``request``; returns its reply.

        Raises:
            ServerUnreachableError: the server cannot be reached.
            HTTPError: the server replied with an error (the matching subclass).
            ConnectionLostError: the reply was lost and the request is not resendable.
            ReplyTimeoutError: no reply in time.
        """
        payload, headers = self._headers(request)
        url = self.url + request.path
        attempt = 0
        while True:
            try:
                async with self._client().request(
                    request.method, url, data=payload or None, headers=headers
                ) as response:
                    body = await response.read()
                    reply_headers = response.headers.items()
                    return self._reply(response.status, reply_headers, body)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise ServerUnreachableError(self.url, str(exc)) from exc
            except TimeoutError as exc:
                if not self._may_resend(request, attempt):
                    raise ReplyTimeoutError(self.url, request.describe(), self.timeout) from exc
            except aiohttp.ClientError as exc:
                if not self._may_resend(request, attempt):
                    reason = str(exc) or type(exc).__name__
                    raise ConnectionLostError(self.url, request.describe(), reason) from exc
            attempt += 1

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
