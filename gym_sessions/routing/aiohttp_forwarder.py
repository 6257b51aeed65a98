"""The reference hop: aiohttp with one ``UnixConnector`` per claimant.

No cookie jar, no default headers, no decompression and no total timeout. A
claimant that refuses connections is gone: its client is discarded and the
caller gets `SessionGoneError`. Kept selectable (``forward_transport="aiohttp"``)
so benchmarks can compare the shipped hop against it in one run.
"""

from __future__ import annotations

import aiohttp
from starlette.types import Scope, Send
from yarl import URL

from gym_sessions.errors import BadGatewayError
from gym_sessions.routing.forwarder import (
    claimant_gone,
    forwarded_headers,
    reply_headers,
    request_target,
)
from gym_sessions.routing.worker_endpoints import UnixEndpoints

__all__ = ["AiohttpForwarder"]
# Idle pooled connections close before the private server would drop them
# (its keep-alive is longer), so a reused connection is never half-closed.
_POOL_KEEPALIVE_SECONDS = 30.0
_POOL_LIMIT = 512


class AiohttpForwarder:
    """Forwards requests to other workers' private sockets with aiohttp.

    Args:
        endpoints: The private sockets in the server's runtime directory.
    """

    def __init__(self, endpoints: UnixEndpoints) -> None:
        self.endpoints = endpoints
        self.socket_path = endpoints.socket_path
        self._clients: dict[str, aiohttp.ClientSession] = {}

    def _client(self, worker_id: str) -> aiohttp.ClientSession:
        client = self._clients.get(worker_id)
        if client is None or client.closed:
            connector = aiohttp.UnixConnector(
                path=self.socket_path(worker_id),
                keepalive_timeout=_POOL_KEEPALIVE_SECONDS,
                limit=_POOL_LIMIT,
            )
            client = aiohttp.ClientSession(
                connector=connector,
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(total=None),
            )
            self._clients[worker_id] = client
        return client

    async def _discard(self, worker_id: str) -> None:
        client = self._clients.pop(worker_id, None)
        if client is not None:
            await client.close()

    async def forward(self, worker_id: str, scope: Scope, body: bytes, send: Send) -> None:
        """Send the request in ``scope`` with ``body`` to ``worker_id``; stream the reply back.

        Raises:
            SessionGoneError: the claimant's socket is gone or refuses connections.
            BadGatewayError: the claimant failed before replying for another reason.
        """
        headers = [
            (name.decode("latin-1"), value.decode("latin-1"))
            for name, value in forwarded_headers(scope)
        ]
        url = URL("http://claimant").join(
            URL(request_target(scope).decode("latin-1"), encoded=True)
        )
        client = self._client(worker_id)
        try:
            response = await client.request(
                scope["method"],
                url,
                headers=headers,
                data=body,
                allow_redirects=False,
                compress=None,
            )
        except aiohttp.ClientConnectorError as exc:
            await self._discard(worker_id)
            raise claimant_gone(worker_id) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            # Either the claimant died while serving, or the connection broke.
            await self._discard(worker_id)
            if not await self.endpoints.reachable(worker_id):
                raise claimant_gone(worker_id) from exc
            raise BadGatewayError(f"forwarding to worker {worker_id} failed: {exc}") from exc
        async with response:
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status,
                    "headers": reply_headers(response.raw_headers),
                }
            )
            async for chunk in response.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def close(self) -> None:
        """Close every client."""
        for worker_id in list(self._clients):
            await self._discard(worker_id)
