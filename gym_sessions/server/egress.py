"""The agent server's HTTP pool: it calls only the allowed upstreams and reads bounded replies.

Every outbound call of an agent server to a model server, and any call of an
agent's own code, goes through one aiohttp session (`AgentServer.http_client`),
made by `egress_session` (env sessions use a `ConnectionPool` per allowed env
server instead, `AgentServer.env_pool`, with the same bounds):

- its connector refuses a URL under no allowed upstream before it opens or
  reuses any connection (`ForbiddenTargetError`, 400 ``forbidden_target``);
  bodies are resolved against the list before that (`UpstreamTargets.resolve`),
  so this is the backstop for an agent's own code;
- a redirect is never followed, and a reply longer than the limit is not read
  past it (`RefusedReplyError`, which agent code reports as 502 ``bad_upstream``);
- the connect and total timeouts apply to every call;
- no cookie jar, and no proxy taken from the environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp

from gym_sessions.errors import ForbiddenTargetError, RefusedReplyError

if TYPE_CHECKING:
    from aiohttp.client_reqrep import ClientRequest
    from aiohttp.connector import Connection
    from aiohttp.tracing import Trace

__all__ = ["BoundedResponse", "GuardedConnector", "egress_session"]

_CHUNK_BYTES = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class GuardedConnector(aiohttp.TCPConnector):
    """A TCP connector that connects only to URLs ``allowed`` accepts.

    Args:
        allowed: Whether a request URL may be called.
        **kwargs: As for `aiohttp.TCPConnector`.
    """

    def __init__(self, allowed: Callable[[str], bool], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._allowed = allowed

    async def connect(
        self,
        req: ClientRequest,
        traces: list[Trace],
        timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109  (aiohttp's signature)
    ) -> Connection:
        if not self._allowed(str(req.url)):
            raise ForbiddenTargetError(
                f"{req.url.origin()} is not an upstream this agent server may call"
            )
        return await super().connect(req, traces, timeout)


class BoundedResponse(aiohttp.ClientResponse):
    """A reply read up to `max_bytes` (after decompression), and never a redirect."""

    max_bytes: ClassVar[int] = 16 * 1024 * 1024

    async def start(self, connection: Connection) -> BoundedResponse:
        await super().start(connection)
        if self.status in _REDIRECTS:
            self.close()
            raise RefusedReplyError(f"the reply is a redirect ({self.status}), never followed")
        return self

    async def read(self) -> bytes:
        if self._body is None:
            body = bytearray()
            try:
                if (self.content_length or 0) > self.max_bytes:
                    raise self._too_large()
                while chunk := await self.content.read(_CHUNK_BYTES):
                    body += chunk
                    if len(body) > self.max_bytes:
                        raise self._too_large()
            except BaseException:
                self.close()
                raise
            self._body = bytes(body)
        return await super().read()

    def _too_large(self) -> RefusedReplyError:
        return RefusedReplyError(f"the reply is larger than {self.max_bytes} bytes")


def egress_session(
    allowed: Callable[[str], bool],
    *,
    max_reply_bytes: int,
    connect_timeout: float,
    total_timeout: float,
) -> aiohttp.ClientSession:
    """The aiohttp session of an agent server's outbound calls (see the module)."""
    response_class = type("BoundedResponse", (BoundedResponse,), {"max_bytes": max_reply_bytes})
    return aiohttp.ClientSession(
        connector=GuardedConnector(allowed, limit=256, keepalive_timeout=30),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=total_timeout, sock_connect=connect_timeout),
        response_class=response_class,
        trust_env=False,
    )
