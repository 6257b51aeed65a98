"""The blocking HTTP shell of the clients: one kept-alive ``http.client`` connection.

A client that keeps one connection per session keeps talking to the worker
that accepted that connection, which is the worker that claimed the session,
so its requests never need a hop. This module only moves bytes and names how a
send failed (`TransportFailure`); what to send, what a reply means and whether
to send again are `gym_sessions.client.exchange`'s, and the recovery of a lost
step reply is `gym_sessions.client.step_recovery`'s.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Iterator
from typing import Any

from gym_sessions.client.exchange import (
    Exchange,
    Failure,
    HTTPClientBase,
    Reply,
    Request,
    TransportFailure,
)
from gym_sessions.client.step_recovery import StepRecovery

__all__ = ["HTTPClient", "HTTPClientBase"]


@contextlib.contextmanager
def _reply_failures() -> Iterator[None]:
    """Report a sent request's socket and ``http.client`` errors as `TransportFailure`."""
    try:
        yield
    except TimeoutError as exc:
        raise TransportFailure.of(Failure.TIMEOUT, exc) from exc
    except (http.client.HTTPException, OSError) as exc:
        raise TransportFailure.of(Failure.LOST, exc) from exc


class HTTPClient(HTTPClientBase):
    """Blocking requests to one server over one connection, carrying the session cookie.

    Arguments as for `HTTPClientBase`.
    """

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
        exchange = self.exchange(request)
        while True:
            try:
                status, headers, body = self._round_trip(exchange)
                return exchange.replied(status, headers, body)
            except TransportFailure as failure:
                exchange.failed(failure)  # returns only to send again

    def send_step(self, step: StepRecovery) -> Reply:
        """Send a step's requests until its reply is in (errors as for `request`)."""
        return step.drive(self.send)

    def _connect(self) -> http.client.HTTPConnection:
        if self._connection is None:
            connection: http.client.HTTPConnection
            if self.ssl_context is not None:
                connection = http.client.HTTPSConnection(
                    self._host, self._port, timeout=self.timeout, context=self.ssl_context
                )
            else:
                connection = http.client.HTTPConnection(
                    self._host, self._port, timeout=self.timeout
                )
            try:
                connection.connect()
                connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError as exc:
                connection.close()
                reason = exc.strerror or str(exc)
                raise TransportFailure(Failure.UNREACHABLE, reason) from exc
            self._connection = connection
        return self._connection

    def _round_trip(self, exchange: Exchange) -> tuple[int, list[tuple[str, str]], bytes]:
        connection = self._connect()
        path = self._prefix + exchange.path
        try:
            with _reply_failures():
                connection.request(exchange.method, path, exchange.payload, exchange.headers)
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
