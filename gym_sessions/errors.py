"""One exception hierarchy for server and client, and the JSON error body.

    GymSessionsError
     ├── StartupError               the server cannot start (bad target, port in use)
     ├── ServerUnreachableError     the client cannot connect to the server
     ├── ConnectionLostError        the connection broke before the reply arrived
     ├── ReplyTimeoutError          no reply within the client's timeout
     ├── StatusError                ``gym-sessions status`` cannot read ``/metrics``
     ├── ToolError                  an MCP tool ran and reported a failure (``isError``)
     ├── RefusedReplyError          an agent stopped reading an upstream's reply (too large,
     │                              a redirect); agent code reports it as 502 bad_upstream
     └── HTTPError                  an error with a status and a JSON body
          ├── InvalidRequestError       400 invalid_request
          │    ├── InvalidJSONError     400 invalid_json
          │    ├── InvalidBinaryError   400 invalid_binary
          │    ├── InvalidSessionIdError 400 invalid_session_id
          │    └── ForbiddenTargetError 400 forbidden_target
          ├── InvalidTokenError         401 invalid_token
          ├── ForbiddenError            403 forbidden
          ├── NotFoundError             404 not_found
          │    └── NoOpenEpisodeError   404 no_open_episode
          ├── MethodNotAllowedError     405 method_not_allowed
          ├── SessionConflictError      409 session_conflict
          │    ├── SessionClosedError   409 session_closed
          │    └── StepOutOfOrderError  409 step_out_of_order
          ├── SessionGoneError          410 session_gone
          │    └── SessionExpiredError  410 session_expired
          ├── RequestTimeoutError       408 request_timeout
          ├── BodyTooLargeError         413 body_too_large
          ├── UnsupportedMediaTypeError 415 unsupported_media_type
          ├── TooManyRequestsError      429 too_many_requests
          ├── HeadersTooLargeError      431 headers_too_large
          ├── EnvError                  500 env_error
          ├── InternalServerError       500 internal_error
          ├── BadGatewayError           502 bad_gateway
          │    └── BadUpstreamError     502 bad_upstream
          ├── ServiceUnavailableError   503 service_unavailable
          │    ├── CapacityReachedError 503 capacity_reached
          │    ├── OverloadedError      503 overloaded
          │    ├── NotReadyError        503 not_ready
          │    └── ClaimsUnavailableError 503 claims_unavailable
          └── GatewayTimeoutError       504 gateway_timeout

The server raises these and `error_response` renders them as
``{"error": {"code": ..., "message": ...}}``; the client turns such a body back
into the same class with `error_from_body`, so both sides share one mapping.
A reply that is not in that format (a proxy's page, another server's) maps by
its status alone, with a message that says so and never quotes a page; the
429, 503 and 504 classes are what the server never sends but proxies do.
"""

from __future__ import annotations

import errno
import json
import re
from http import HTTPStatus
from typing import Any, ClassVar

__all__ = [
    "BadGatewayError",
    "BadUpstreamError",
    "BodyTooLargeError",
    "CapacityReachedError",
    "ClaimsUnavailableError",
    "ConnectionLostError",
    "EnvError",
    "ForbiddenError",
    "ForbiddenTargetError",
    "GatewayTimeoutError",
    "GymSessionsError",
    "HTTPError",
    "HeadersTooLargeError",
    "InternalServerError",
    "InvalidBinaryError",
    "InvalidJSONError",
    "InvalidRequestError",
    "InvalidSessionIdError",
    "InvalidTokenError",
    "MethodNotAllowedError",
    "NoOpenEpisodeError",
    "NotFoundError",
    "NotReadyError",
    "OverloadedError",
    "RefusedReplyError",
    "ReplyTimeoutError",
    "RequestTimeoutError",
    "ServerUnreachableError",
    "ServiceUnavailableError",
    "SessionClosedError",
    "SessionConflictError",
    "SessionExpiredError",
    "SessionGoneError",
    "StartupError",
    "StatusError",
    "StepOutOfOrderError",
    "TooManyRequestsError",
    "ToolError",
    "UnsupportedMediaTypeError",
    "error_body",
    "error_from_body",
    "error_headers",
    "exception_text",
    "foreign_reply_error",
    "jsonrpc_error_body",
    "out_of_resources",
    "unexpected_error",
    "unreadable_reply_error",
]


class GymSessionsError(Exception):
    """Base class of every error gym-sessions raises."""


class StartupError(GymSessionsError):
    """The server cannot start: a bad target, a port in use, a bad setting."""


class StatusError(GymSessionsError):
    """``gym-sessions status`` cannot read the server's ``/metrics`` (unreachable, refused)."""


class ServerUnreachableError(GymSessionsError, ConnectionError):
    """The client could not connect to the server at ``url``."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach gym-sessions server at {url}: {reason}")
        self.url = url


class ConnectionLostError(GymSessionsError, ConnectionError):
    """The connection broke after a request was sent and before its reply arrived.

    The request may or may not have run on the server. Requests that are safe to
    send again have been resent before this is raised.
    """

    def __init__(self, url: str, what: str, reason: str) -> None:
        super().__init__(f"{what} to {url}: {reason}")
        self.url = url


class ReplyTimeoutError(GymSessionsError, TimeoutError):
    """No reply within the client's per-request timeout (after any safe resends)."""

    def __init__(self, url: str, what: str, timeout: float) -> None:
        super().__init__(f"no reply to {what} from {url} within {timeout:g} s")
        self.url = url


class ToolError(GymSessionsError):
    """An MCP tool call ran and its result says it failed (``isError``: an action outside
    the space, no open episode); the message is the tool's own text."""


class RefusedReplyError(GymSessionsError):
    """An agent server stopped reading an upstream's reply: larger than
    ``upstream_max_reply_bytes``, or a redirect (never followed).

    Raised by the agent's HTTP pool (`gym_sessions.server.egress`); the agent's
    env sessions and policies report it as `BadUpstreamError` naming the upstream.
    """


class HTTPError(GymSessionsError):
    """An error with an HTTP status and a machine-readable code."""

    status: ClassVar[int] = 500
    code: ClassVar[str] = "internal_error"
    #: Seconds a client should wait before trying again (a ``Retry-After`` header), if any.
    retry_after: ClassVar[int | None] = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequestError(HTTPError):
    status, code = 400, "invalid_request"


class InvalidJSONError(InvalidRequestError):
    status, code = 400, "invalid_json"


class InvalidBinaryError(InvalidRequestError):
    """A body in the binary values encoding is not a well-formed message (docs/design.md §3.15)."""

    status, code = 400, "invalid_binary"


class InvalidSessionIdError(InvalidRequestError):
    status, code = 400, "invalid_session_id"


class ForbiddenTargetError(InvalidRequestError):
    """A body named an upstream (env or model server) the agent server was not started with.

    No connection was made (docs/security.md).
    """

    status, code = 400, "forbidden_target"


class InvalidTokenError(HTTPError):
    status, code = 401, "invalid_token"


class NotFoundError(HTTPError):
    status, code = 404, "not_found"


class NoOpenEpisodeError(NotFoundError):
    status, code = 404, "no_open_episode"


class MethodNotAllowedError(HTTPError):
    status, code = 405, "method_not_allowed"


class ForbiddenError(HTTPError):
    status, code = 403, "forbidden"


class SessionConflictError(HTTPError):
    status, code = 409, "session_conflict"


class SessionClosedError(SessionConflictError):
    status, code = 409, "session_closed"


class StepOutOfOrderError(SessionConflictError):
    """A ``/step`` sent for another episode length than the episode has (``x-gym-episode-length``).

    The step did not run. For a client recovering a lost reply it means an
    earlier send of the same step ran first (it may have been delayed in a hop).
    """

    status, code = 409, "step_out_of_order"


class SessionGoneError(HTTPError):
    status, code = 410, "session_gone"


class SessionExpiredError(SessionGoneError):
    """The session had no request for the server's idle timeout and was closed."""

    status, code = 410, "session_expired"


class RequestTimeoutError(HTTPError):
    status, code = 408, "request_timeout"


class BodyTooLargeError(HTTPError):
    status, code = 413, "body_too_large"


class TooManyRequestsError(HTTPError):
    """A proxy or rate limiter in front of the server refused the request for now."""

    status, code = 429, "too_many_requests"


class UnsupportedMediaTypeError(HTTPError):
    """A body in an encoding the route does not take (binary on a JSON route, another version)."""

    status, code = 415, "unsupported_media_type"


class HeadersTooLargeError(HTTPError):
    status, code = 431, "headers_too_large"


class EnvError(HTTPError):
    status, code = 500, "env_error"


class InternalServerError(HTTPError):
    status, code = 500, "internal_error"


class BadGatewayError(HTTPError):
    status, code = 502, "bad_gateway"


class BadUpstreamError(BadGatewayError):
    """An upstream (env or model server) answered, but not with what the protocol needs."""

    status, code = 502, "bad_upstream"


class ServiceUnavailableError(HTTPError):
    """The server, or a proxy in front of it, cannot take the request now (try again later)."""

    status, code = 503, "service_unavailable"


class CapacityReachedError(ServiceUnavailableError):
    """Every worker holds as many of a bounded resource as it may (try again later)."""

    status, code = 503, "capacity_reached"
    retry_after = 5


class OverloadedError(ServiceUnavailableError):
    """The worker is short of a resource for now (request-body memory, file descriptors)."""

    status, code = 503, "overloaded"
    retry_after = 1


class NotReadyError(ServiceUnavailableError):
    """``GET /ready``: this worker takes no new sessions now (draining, stopping)."""

    status, code = 503, "not_ready"


class ClaimsUnavailableError(ServiceUnavailableError):
    """The claim store (Redis) cannot be reached: nobody can tell which worker holds a session."""

    status, code = 503, "claims_unavailable"


class GatewayTimeoutError(HTTPError):
    """A proxy in front of the server waited too long for it."""

    status, code = 504, "gateway_timeout"


def _all_http_errors(cls: type[HTTPError]) -> list[type[HTTPError]]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_http_errors(sub))
    return found


_BY_CODE: dict[str, type[HTTPError]] = {cls.code: cls for cls in _all_http_errors(HTTPError)}
# For error replies that did not come from the framework (a proxy's page, say).
_BY_STATUS: dict[int, type[HTTPError]] = {
    cls.status: cls for cls in _all_http_errors(HTTPError) if cls.__base__ is HTTPError
}


#: The title of a foreign reply's HTML page (nginx's says what it refused).
_TITLE = re.compile(rb"<title[^>]*>([^<]{1,200})</title>", re.IGNORECASE)

_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def out_of_resources(exc: OSError) -> bool:
    """Whether ``exc`` says this process is short of descriptors or memory (not a peer's fault)."""
    return exc.errno in _RESOURCE_ERRNOS


def exception_text(exc: BaseException) -> str:
    """What an error reply may say of ``exc``: its type and text, never a file name.

    An `OSError`'s text names the files it was about (a metrics file, the
    runtime directory, an interpreter's path): server paths, which a client is
    not told. Only its ``strerror`` is kept.
    """
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or 'operating system error'}"
    return f"{type(exc).__name__}: {exc}"


def unexpected_error(exc: BaseException) -> HTTPError:
    """The reply for an exception no handler answered.

    503 ``overloaded`` when the worker is short of descriptors or memory (a
    passing state; the request may be retried), else 500 ``internal_error``.
    Either names the exception's type only: its text may hold server paths or
    other internals, which the server's log has.
    """
    if isinstance(exc, OSError) and out_of_resources(exc):
        return OverloadedError(f"this worker is short of resources: {exc.strerror}")
    return InternalServerError(f"internal error: {type(exc).__name__} (see the server log)")


def error_headers(error: HTTPError) -> list[tuple[bytes, bytes]]:
    """Headers an error reply carries beside its JSON body (``Retry-After``)."""
    if error.retry_after is None:
        return []
    return [(b"retry-after", str(error.retry_after).encode())]


def error_body(error: HTTPError) -> bytes:
    """The JSON body of ``error``: ``{"error": {"code": ..., "message": ...}}``."""
    return json.dumps({"error": {"code": error.code, "message": error.message}}).encode()


# JSON-RPC "server error" code for framework errors; ``data`` carries code and status.
JSONRPC_SERVER_ERROR = -32001


def jsonrpc_error_body(error: HTTPError, request_id: object = None) -> bytes:
    """``error`` as a JSON-RPC error object, for endpoints that speak JSON-RPC (MCP)."""
    return json.dumps(
        {
            "jsonrpc": "2.0",
            "id": request_id,
            "error": {
                "code": JSONRPC_SERVER_ERROR,
                "message": f"{error.code}: {error.message}",
                "data": {"code": error.code, "status": error.status},
            },
        }
    ).encode()


def error_from_body(
    status: int, body: bytes, *, url: str | None = None, what: str | None = None
) -> HTTPError:
    """The exception a client raises for an error reply with ``status`` and ``body``.

    A body in the framework's format (or its JSON-RPC form, `jsonrpc_error_body`)
    maps by its code; any other reply (a proxy's HTML page, another server's)
    is `foreign_reply_error`'s.

    Args:
        status: The reply's status.
        body: The reply's body.
        url: The server's URL, for the message of a reply that is not ours.
        what: The request (``"GET /spaces"``), for that message too.
    """
    try:
        parsed: Any = json.loads(body)
        code = parsed["error"]["code"]
        message = str(parsed["error"]["message"])
        if "jsonrpc" in parsed:  # a JSON-RPC error object names the code in its data
            code = parsed["error"]["data"]["code"]
    except (ValueError, TypeError, KeyError):
        return foreign_reply_error(status, body, url=url, what=what)
    cls = _BY_CODE.get(code) if isinstance(code, str) else None
    cls = cls or _BY_STATUS.get(status, HTTPError)
    error = cls(message)
    if error.status != status:
        error.status = status  # type: ignore[misc]
    return error


def unreadable_reply_error(status: int, reason: str, *, url: str, what: str) -> HTTPError:
    """The exception for a reply whose bytes this client cannot read (an encoding, say).

    ``HTTPError`` with the reply's status and code ``unexpected_reply``, as
    `foreign_reply_error` gives.
    """
    error = HTTPError(f"{what} to {url}: HTTP {status} reply that cannot be read: {reason}")
    error.status, error.code = status, "unexpected_reply"  # type: ignore[misc]
    return error


def foreign_reply_error(
    status: int, body: bytes, *, url: str | None = None, what: str | None = None
) -> HTTPError:
    """The exception for a reply that did not come from gym-sessions, by its status alone.

    The class is the one of ``status`` (``HTTPError`` with code
    ``unexpected_reply`` for a status no class has, a 200 among them); the
    message names the request and URL, says the reply is not gym-sessions',
    and describes the body without quoting a page of it.
    """
    cls = _BY_STATUS.get(status)
    try:
        phrase = f" {HTTPStatus(status).phrase}"
    except ValueError:
        phrase = ""
    where = f"{what or 'a request'} to {url}: " if url else ""
    server = url or "the server"
    error = (cls or HTTPError)(
        f"{where}HTTP {status}{phrase} with {_described(body)}, not a gym-sessions reply: "
        f"{server} is not a gym-sessions server, or a proxy in front of it answered"
    )
    if cls is None:
        error.status, error.code = status, "unexpected_reply"  # type: ignore[misc]
    return error


def _described(body: bytes) -> str:
    """What a foreign reply's body is, in a few words (a short text is quoted, a page never)."""
    start = body[:512].lstrip()
    if not start:
        return "an empty body"
    if start[:1] == b"<":
        title = _TITLE.search(body[:4096])
        text = " ".join(title.group(1).decode("utf-8", "replace").split()) if title else ""
        if text and text.isprintable() and "<" not in text:
            return f"an HTML page titled {text[:120]!r}"
        return "an HTML page"
    try:
        json.loads(body)
    except ValueError:
        pass
    else:
        return "a JSON body"
    text = start.decode("utf-8", "replace").splitlines()[0].strip()
    if text.isprintable():
        return f"the text {text[:120]!r}"
    return f"a {len(body)}-byte body"
