"""asyncio HTTP plumbing for the clients: aiohttp with one kept-alive connection per session.

The connector holds at most one connection (``limit=1``), so every request of a
session goes over the connection that started it and reaches the worker that
claimed the session, with no routing hop. If that connection closes, the next
one carries the session cookie and the server routes it to the claimant. No
cookie jar: the session cookie is kept by hand, as in the blocking client, so
that sessions sharing a host never see each other's cookie.
"""

from __future__ import annotations

import aiohttp

from gym_sessions.client.http import HTTPClientBase
from gym_sessions.client.protocol import Reply, Request
from gym_sessions.errors import ConnectionLostError, ReplyTimeoutError, ServerUnreachableError

__all__ = ["AsyncHTTPClient"]

# The client drops an idle connection before the server would (its keep-alive
# is 120 s), so a kept-alive connection is never reused half-closed.
_IDLE_SECONDS = 60.0


class AsyncHTTPClient(HTTPClientBase):
    """``await send(request)`` over one kept-alive connection (see `HTTPClientBase`).

    The aiohttp session is made on first use, inside the running event loop,
    and belongs to that loop.
    """

    _session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=1, force_close=not self.keep_alive, keepalive_timeout=_IDLE_SECONDS
            )
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
