"""Blocking HTTP plumbing for the clients: one kept-alive connection, the session cookie, errors.

A client that keeps one connection per session keeps talking to the worker
that accepted that connection, which is the worker that claimed the session,
so its requests never need a hop. Error replies become the exceptions of
`gym_sessions.errors`; a refused connection becomes `ServerUnreachableError`
naming the URL. A reply lost to a broken connection or a timeout is retried
(``retries`` times) only for requests marked resendable
(`gym_sessions.client.protocol.Request`); otherwise it raises
`ConnectionLostError` or `ReplyTimeoutError`.

`HTTPClientBase` holds what the blocking `HTTPClient` and the asyncio
`AsyncHTTPClient` share: the URL, the cookie, request headers and reply decoding.
A caller's extra ``headers`` (an authenticating proxy's, say) go on every request.
"""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from gym_sessions.client.protocol import Reply, Request
from gym_sessions.errors import (
    ConnectionLostError,
    ReplyTimeoutError,
    ServerUnreachableError,
    error_from_body,
)

__all__ = ["HTTPClient", "HTTPClientBase"]

#: Headers only the client sets: a caller's value would break the request's framing.
_FRAMING_HEADERS = frozenset(
    {"connection", "content-length", "content-type", "host", "transfer-encoding"}
)


def _checked_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """A copy of a caller's extra headers; raises for ones the client must set itself."""
    checked: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise TypeError(f"header names and values must be str, not {name!r}: {value!r}")
        if name.lower() in _FRAMING_HEADERS:
            raise ValueError(f"header {name!r} is set by the client itself")
        if any(c in name + value for c in "\r\n\0"):
            raise ValueError(f"header {name!r} contains a line break or NUL")
        checked[name] = value
    return checked


class HTTPClientBase:
    """URL, session cookie, headers and reply decoding shared by both HTTP clients.

    Args:
        url: Server base URL, ``http://host:port`` (a path prefix is kept).
        timeout: Seconds to wait for connect and for each reply.
        keep_alive: Reuse one connection (the default). ``False`` opens a new
            connection per request, as pooled clients and load balancers do.
        retries: How many times a resendable request is sent again after its
            reply was lost (a broken connection or a timeout).
        cookie_name: The server's session cookie name.
        headers: Extra headers sent with every request (an authenticating
            proxy's, say). A ``Cookie`` here is sent along with the session
            cookie; framing headers (``Content-Type``, ``Connection``, ...) are refused.

    Raises:
        ValueError: a bad URL, or a header the client sets itself.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        keep_alive: bool = True,
        retries: int = 1,
        cookie_name: str = "gym_session",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url must look like http://host:port, not {url!r}")
        self.url = url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or 80
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.keep_alive = keep_alive
        self.retries = retries
        self.cookie_name = cookie_name
        self.cookie: str | None = None
        #: The caller's extra headers, sent with every request.
        self.headers = _checked_headers(headers)

    def _headers(self, request: Request) -> tuple[bytes, dict[str, str]]:
        """The body and headers to send for ``request``."""
        if request.new_session:
            self.cookie = None  # an earlier session's cookie beside the new id would get a 409
        headers = {name: value for name, value in self.headers.items() if name.lower() != "cookie"}
        if not any(name.lower() == "accept" for name in headers):
            headers["Accept"] = "application/json"
        payload = b""
        if request.body is not None:
            payload = json.dumps(request.body, allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        cookies = [value for name, value in self.headers.items() if name.lower() == "cookie"]
        if self.cookie:
            cookies.append(f"{self.cookie_name}={self.cookie}")
        if cookies:  # one Cookie header: the caller's cookies and the session's
            headers["Cookie"] = "; ".join(cookies)
        if not self.keep_alive:
            headers["Connection"] = "close"
        headers.update(request.headers)
        return payload, headers

    def _may_resend(self, request: Request, attempt: int) -> bool:
        return request.resendable and attempt < self.retries

    def _reply(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> Reply:
        """Remember the session cookie; raise the error an error reply stands for."""
        lowered: dict[str, str] = {}
        for name, value in headers:
            name = name.lower()
            lowered[name] = value
            if name == "set-cookie":
                key, _, rest = value.split(";", 1)[0].partition("=")
                if key.strip() == self.cookie_name:
                    self.cookie = rest.strip() or None
        if status >= 400:
            raise error_from_body(status, body)
        return Reply(status, lowered, body)


class HTTPClient(HTTPClientBase):
    """Blocking requests to one server over one connection, carrying the session cookie."""

    _connection: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        headers: dict[str, str] | None = None,
        *,
        resendable: bool | None = None,
    ) -> Any:
        """Send a JSON request; returns the parsed JSON reply.

        Args:
            resendable: Whether a lost reply may be retried; by default only for ``GET``.

        Raises:
            ServerUnreachableError: the server cannot be reached.
            HTTPError: the server replied with an error (the matching subclass).
            ConnectionLostError: the reply was lost and the request is not resendable.
            ReplyTimeoutError: no reply in time.
        """
        resend = method == "GET" if resendable is None else resendable
        return self.send(Request(method, path, body, headers or {}, resend)).json()

    def send(self, request: Request) -> Reply:
        """Send ``request``; returns its reply (errors as for `request`)."""
        payload, headers = self._headers(request)
        path = self._prefix + request.path
        attempt = 0
        while True:
            try:
                status, reply_headers, data = self._exchange(request.method, path, payload, headers)
            except ServerUnreachableError:
                raise
            except TimeoutError as exc:
                if not self._may_resend(request, attempt):
                    raise ReplyTimeoutError(self.url, request.describe(), self.timeout) from exc
            except (http.client.HTTPException, OSError) as exc:
                if not self._may_resend(request, attempt):
                    reason = str(exc) or type(exc).__name__
                    raise ConnectionLostError(self.url, request.describe(), reason) from exc
            else:
                return self._reply(status, reply_headers, data)
            attempt += 1

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
            try:
                connection.connect()
                connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                connection.close()
                raise ServerUnreachableError(self.url, exc.strerror or str(exc)) from exc
            self._connection = connection
        return self._connection

    def _exchange(
        self, method: str, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = self._connect()
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except BaseException:
            self.close()  # a half-used connection cannot carry another request
            raise
        if not self.keep_alive or response.will_close:
            self.close()
        return response.status, response.getheaders(), data

    def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None
