"""An `HTTPError` sent as a whole ASGI reply: the JSON error body (§3.7) and its headers.

The router, the metrics endpoint and the step batch route answer errors
before (or instead of) the Starlette app, straight through ``send``.
"""

from __future__ import annotations

from starlette.types import Send

from gym_sessions.errors import (
    ForbiddenError,
    HeadersTooLargeError,
    HTTPError,
    OverloadedError,
    RequestTimeoutError,
    error_body,
    error_headers,
    jsonrpc_error_body,
)

__all__ = ["send_error"]

# A stalled body will not arrive, an unsigned request on a private listener is
# not read, and a connection that sent an oversized head is not one to keep
# (as when `BoundedHttpProtocol` refuses it): close the connection with the
# reply. (A body that is too large still arrives; uvicorn reads and drops it,
# and closing early would reset the connection before the client reads the 413.)
_UNREAD_BODY_ERRORS = (RequestTimeoutError, ForbiddenError, OverloadedError, HeadersTooLargeError)


async def send_error(send: Send, error: HTTPError, *, jsonrpc: bool = False) -> None:
    """Reply with ``error``'s JSON body (as a JSON-RPC error object on JSON-RPC paths)."""
    body = jsonrpc_error_body(error) if jsonrpc else error_body(error)
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *error_headers(error),
    ]
    if isinstance(error, _UNREAD_BODY_ERRORS):
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
