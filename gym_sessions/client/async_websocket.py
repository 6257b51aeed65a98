"""The WebSocket shell of the clients: a session's requests as messages of one ``/ws`` connection.

`AsyncWebSocketClient` sends each `Exchange` as one request envelope
(``docs/design.md`` §3.16) and turns the reply message back into status,
headers and body, so the rules of a reply, a lost send and a lost step are the
ones of HTTP (`gym_sessions.client.exchange`, `gym_sessions.client.step_recovery`):
this module only moves messages and names how a send failed.

The connection is opened on first use with the caller's headers and the
session cookie in its upgrade request. The server keeps the cookie for the
connection's requests; the client keeps the one replies set (`HTTPClientBase`),
so when the connection drops the next request opens a new one that carries it,
and reaches the same session on its holder whichever worker accepts it. A step
whose reply the drop lost is resolved by `StepRecovery` over the new
connection: ``/observe``, then the resend at the step's episode length, which
runs only if the first send did not (it ran once or not at all).

The connection asks for the ``gym-sessions.values.v1`` subprotocol, so values
travel as they do over HTTP: a binary step body (§3.15) goes as a binary frame
(its envelope's length, the envelope, then the body), and a binary reply comes
as one; everything else is a JSON text message.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import ssl
from collections.abc import Mapping
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI
from websockets.protocol import State
from websockets.typing import Subprotocol

from gym_sessions.client.exchange import (
    EncodedBody,
    Exchange,
    Failure,
    HTTPClientBase,
    Reply,
    Request,
    TransportFailure,
)
from gym_sessions.client.step_recovery import StepRecovery
from gym_sessions.wire import (
    CLOSE_FOLLOWS_HEADER,
    EPISODE_LENGTH_HEADER,
    SESSION_COOKIE,
    VALUES_SUBPROTOCOL,
    WEBSOCKET_PATH,
    WS_ENVELOPE_BYTES,
)

__all__ = ["AsyncWebSocketClient"]

#: The request headers an envelope carries (the server refuses any other).
_MESSAGE_HEADERS = frozenset({EPISODE_LENGTH_HEADER, CLOSE_FOLLOWS_HEADER, "accept"})

#: A JSON reply body as the HTTP shell would hand it on; one encoder, not one per reply.
_BODY_ENCODER = json.JSONEncoder(allow_nan=False)

#: Bytes of a binary frame's envelope length (big-endian), before the envelope.
_LENGTH_BYTES = 4


class AsyncWebSocketClient(HTTPClientBase):
    """``await send(request)`` over one ``/ws`` connection (arguments as `HTTPClientBase`).

    ``keep_alive`` is ignored: a WebSocket is one connection. ``max_message_bytes``
    bounds a reply message (the server's ``max_body_bytes`` and an envelope).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 60.0,
        retries: int = 1,
        cookie_name: str = SESSION_COOKIE,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        max_message_bytes: int = 16 * 1024 * 1024 + WS_ENVELOPE_BYTES,
    ) -> None:
        super().__init__(
            url,
            timeout=timeout,
            retries=retries,
            cookie_name=cookie_name,
            headers=headers,
            ssl_context=ssl_context,
        )
        scheme = "wss" if url.startswith("https") else "ws"
        self.ws_url = f"{scheme}://{self.url.split('://', 1)[1]}{WEBSOCKET_PATH}"
        self.max_message_bytes = max_message_bytes
        self._connection: ClientConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)

    async def send(self, request: Request, *, over: Any = None) -> Reply:
        """Send ``request``; returns its reply (errors as `AsyncHTTPClient.send`).

        ``over`` is accepted for the HTTP shell's signature and ignored: a
        WebSocket speaks for its own session only.
        """
        exchange = self.exchange(request)
        while True:
            try:
                status, headers, body = await self._round_trip(exchange)
                return exchange.replied(status, headers, body)
            except TransportFailure as failure:
                exchange.failed(failure)  # returns only to send again

    async def send_step(self, step: StepRecovery) -> Reply:
        """Send a step's requests until its reply is in (errors as for `send`)."""
        return await step.drive_async(self.send)

    def _envelope(self, exchange: Exchange, request_id: int) -> str | bytes:
        headers = {
            name.lower(): value
            for name, value in exchange.headers.items()
            if name.lower() in _MESSAGE_HEADERS
        }
        head = json.dumps(
            {
                "id": request_id,
                "method": exchange.method,
                "path": exchange.path,
                "headers": headers,
                "new_session": exchange.request.new_session,
            }
        )
        if isinstance(exchange.request.body, EncodedBody):
            envelope = head.encode()
            length = len(envelope).to_bytes(_LENGTH_BYTES, "big")
            return length + envelope + exchange.payload
        if not exchange.payload:
            return head
        # The payload is the strict JSON the HTTP shell would send: spliced in as it is.
        return head[:-1] + ', "body": ' + exchange.payload.decode() + "}"

    async def _connected(self, exchange: Exchange) -> ClientConnection:
        loop = asyncio.get_running_loop()
        if self._connection is not None and self._loop is loop:
            return self._connection
        await self.close()
        upgrade = {
            name: value for name, value in exchange.headers.items() if name.lower() == "cookie"
        }
        upgrade.update(
            (name, value) for name, value in self.headers.items() if name.lower() != "cookie"
        )
        try:
            self._connection = await connect(
                self.ws_url,
                additional_headers=upgrade,
                ssl=self.ssl_context,
                open_timeout=self.timeout,
                max_size=self.max_message_bytes,
                subprotocols=[Subprotocol(VALUES_SUBPROTOCOL)],
                compression=None,
                ping_interval=None,  # a session may wait long for a step; the server pings
                user_agent_header=None,
            )
        except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            raise TransportFailure.of(Failure.UNREACHABLE, exc) from exc
        self._loop = loop
        return self._connection

    async def _round_trip(self, exchange: Exchange) -> tuple[int, list[tuple[str, str]], bytes]:
        request_id = next(self._ids)
        envelope = self._envelope(exchange, request_id)
        connection = await self._connected(exchange)
        if connection.state is not State.OPEN:
            await self.close()  # closed by the server since (a 410's 4410): open anew
            connection = await self._connected(exchange)
        try:
            await connection.send(envelope)
        except ConnectionClosed as exc:
            await self.close()
            raise TransportFailure.of(Failure.LOST, exc) from exc
        try:
            while True:
                async with asyncio.timeout(self.timeout):
                    text = await connection.recv()
                binary_body = None
                if isinstance(text, bytes):  # a binary reply: its envelope, then its body
                    end = _LENGTH_BYTES + int.from_bytes(text[:_LENGTH_BYTES], "big")
                    message, binary_body = json.loads(text[_LENGTH_BYTES:end]), text[end:]
                else:
                    message = json.loads(text)
                if message.get("id") == request_id:
                    break  # (an earlier request's late reply is dropped)
        except TimeoutError as exc:
            await self.close()  # its reply may still come: never read it as another's
            raise TransportFailure.of(Failure.TIMEOUT, exc) from exc
        except (ConnectionClosed, ValueError, TypeError) as exc:
            await self.close()
            raise TransportFailure.of(Failure.LOST, exc) from exc
        headers = [(str(name), str(value)) for name, value in message.get("headers", [])]
        body = message.get("body")
        if binary_body is not None:
            return int(message["status"]), headers, binary_body
        if body is None:
            payload = b""
        elif isinstance(body, str) and not _is_json_reply(headers):
            payload = body.encode()
        else:
            payload = _BODY_ENCODER.encode(body).encode()
        return int(message["status"]), headers, payload

    async def close(self) -> None:
        """Close the connection (a later request opens a new one, with the cookie)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                await connection.close()

    def close_soon(self) -> None:
        """Drop the connection without ``await``, from any thread; never raises."""
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.transport.abort()


def _is_json_reply(headers: list[tuple[str, str]]) -> bool:
    return any(
        name.lower() == "content-type" and value.startswith("application/json")
        for name, value in headers
    )
