"""Blocking HTTP plumbing for the clients: one kept-alive connection, the session cookie, errors.

A client that keeps one connection per session keeps talking to the worker
that accepted that connection, which is the worker that claimed the session,
so its requests never need a hop. Error replies become the exceptions of
`gym_sessions.errors`; a refused connection becomes `ServerUnreachableError`
naming the URL.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any
from urllib.parse import urlsplit

from gym_sessions.errors import ServerUnreachableError, error_from_body

__all__ = ["HTTPClient"]

# A kept-alive connection the server closed while idle fails on first use like this.
_STALE_CONNECTION_ERRORS = (
    http.client.RemoteDisconnected,
    ConnectionResetError,
    BrokenPipeError,
)


class HTTPClient:
    """JSON requests to one server over one connection, carrying the session cookie.

    Args:
        url: Server base URL, ``http://host:port`` (a path prefix is kept).
        timeout: Seconds to wait for connect and for each reply.
        keep_alive: Reuse one connection (the default). ``False`` opens a new
            connection per request, as pooled clients and load balancers do.
        cookie_name: The server's session cookie name.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        keep_alive: bool = True,
        cookie_name: str = "gym_session",
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
        self.cookie_name = cookie_name
        self.cookie: str | None = None
        self._connection: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> Any:
        """Send a JSON request; returns the parsed JSON reply.

        Raises:
            ServerUnreachableError: the server cannot be reached.
            HTTPError: the server replied with an error (the matching subclass).
        """
        payload = b"" if body is None else json.dumps(body, allow_nan=False).encode()
        send_headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.cookie:
            send_headers["Cookie"] = f"{self.cookie_name}={self.cookie}"
        if not self.keep_alive:
            send_headers["Connection"] = "close"
        send_headers.update(headers or {})
        status, reply_headers, data = self._exchange(
            method, self._prefix + path, payload, send_headers
        )
        self._remember_cookie(reply_headers)
        if status >= 400:
            raise error_from_body(status, data)
        return json.loads(data) if data else None

    def _exchange(
        self, method: str, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        reused = self._connection is not None
        try:
            return self._send(method, path, payload, headers)
        except _STALE_CONNECTION_ERRORS:
            self.close()
            if not reused:
                raise
            # The server dropped an idle kept-alive connection before reading
            # this request: nothing ran, so sending it again is safe.
            return self._send(method, path, payload, headers)

    def _send(
        self, method: str, path: str, payload: bytes, headers: dict[str, str]
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        if self._connection is None:
            self._connection = http.client.HTTPConnection(
                self._host, self._port, timeout=self.timeout
            )
            try:
                self._connection.connect()
                self._connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                self._connection = None
                raise ServerUnreachableError(self.url, exc.strerror or str(exc)) from exc
        connection = self._connection
        try:
            connection.request(method, path, body=payload, headers=headers)
            response = connection.getresponse()
            data = response.read()
        except BaseException:
            self.close()
            raise
        if not self.keep_alive or response.will_close:
            self.close()
        return response.status, response.getheaders(), data

    def _remember_cookie(self, headers: list[tuple[str, str]]) -> None:
        for name, value in headers:
            if name.lower() == "set-cookie":
                pair = value.split(";", 1)[0]
                key, _, cookie = pair.partition("=")
                if key.strip() == self.cookie_name:
                    self.cookie = cookie.strip() or None

    def close(self) -> None:
        """Close the connection (a later request opens a new one)."""
        if self._connection is not None:
            self._connection.close()
            self._connection = None
