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
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

__all__ = ["PRIVATE_SCOPE_KEY", "PrivateListener"]

PRIVATE_SCOPE_KEY = "gym_sessions.private"
# Forwarding clients pool connections for less than this, so the listener never
# closes a connection a client is about to reuse. On TCP (reachable from the
# network) idle connections go sooner; the forwarder retries a pooled
# connection the listener closed while idle.
_KEEP_ALIVE_SECONDS = 3600
_TCP_KEEP_ALIVE_SECONDS = 300


class _MarkPrivate:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[PRIVATE_SCOPE_KEY] = True
        await self.app(scope, receive, send)


def _quiet_protocol(protocol_class: type) -> type:
    class QuietProtocol(protocol_class):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The receiving worker already logs the request once.
            self.access_log = False

    return QuietProtocol


class PrivateListener:
    """Serves ``app`` on the Unix socket at ``path`` (or TCP on ``host``) until `stop`.

    Args:
        app: The worker's ASGI app (the same object the public server runs).
        path: Socket path, inside the runtime directory's ``workers/``.
        host: Listen on TCP on this address instead, on a port the system picks
            (`address` tells which, once started).
        private: Mark requests as arrived over a private socket. Tests turn it
            off to give in-process workers a public listener of their own.
    """

    def __init__(
        self,
        app: ASGIApp,
        path: str | None = None,
        *,
        host: str | None = None,
        private: bool = True,
    ) -> None:
        if (path is None) == (host is None):
            raise ValueError("a private listener needs a socket path or a host, not both")
        self.path = path
        self.host = host
        self.address: tuple[str, int] | None = None
        self._config = uvicorn.Config(
            _MarkPrivate(app) if private else app,
            uds=path,
            lifespan="off",
            log_config=None,
            log_level=None,
            access_log=True,  # False would strip handlers from the process-wide logger
            proxy_headers=False,
            server_header=False,
            date_header=False,
            timeout_keep_alive=_KEEP_ALIVE_SECONDS if path is not None else _TCP_KEEP_ALIVE_SECONDS,
            ws="none",
        )
        self._config.load()
        self._protocol_class = _quiet_protocol(self._config.http_protocol_class)
        self._state = ServerState()
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        """Start listening."""
        config, state, protocol_class = self._config, self._state, self._protocol_class
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            return protocol_class(config=config, server_state=state, app_state={})

        if self.path is not None:
            self._server = await loop.create_unix_server(
                protocol, path=self.path, backlog=config.backlog
            )
            os.chmod(self.path, 0o600)
        else:
            self._server = await loop.create_server(
                protocol, host=self.host, port=0, backlog=config.backlog
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
