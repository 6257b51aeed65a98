"""What one HTTP request of a client means, without I/O: its bytes, its reply, its failures.

Every client request goes through a shell that only moves bytes:
`gym_sessions.client.http.HTTPClient` (blocking),
`gym_sessions.client.async_http.AsyncHTTPClient` (asyncio: our own HTTP/1.1
connection, or a shared `ConnectionPool`; `RemoteVectorEnv`
uses it too) or `gym_sessions.client.async_websocket.AsyncWebSocketClient`
(``/ws``). Each shell turns its library's errors into a `TransportFailure` and
leaves every decision to an `Exchange`, so the rules below are written once:

- the bytes (`HTTPClientBase.exchange`): the JSON body (strict: no NaN) or an
  `EncodedBody` as it is (a binary message), the caller's extra headers, the
  session cookie in one ``Cookie`` header with the caller's cookies, and no
  cookie on a session's first start (`Request.new_session`);
- a reply (`Exchange.replied`): the session cookie it sets is kept, and an
  error status raises the class of `gym_sessions.errors` that the server
  raised (`error_from_body`: by the body's code, else by the status, with a
  message naming the URL: the reply is another server's, or a proxy's); an
  HTML page with any status is never ours either; this is the clients' one
  place that maps statuses to exceptions;
- a send that got no reply (`Exchange.failed`):

  ============  ==========================  ===========================================
  failure       may the request have run?   then
  ============  ==========================  ===========================================
  UNREACHABLE   no (no connection)          `ServerUnreachableError` at once
  LOST          yes (sent, then broken)     resend if resendable and a retry is left,
                                            else `ConnectionLostError`; a 502
                                            ``bad_gateway`` reply (a hop behind the
                                            server broke) is the same, but raises
                                            `BadGatewayError` when not resent
  TIMEOUT       yes (sent, no reply)        resend if resendable and a retry is left,
                                            else `ReplyTimeoutError`
  ============  ==========================  ===========================================

Which requests are resendable is the session protocol's call
(`gym_sessions.client.protocol`); a lost ``/step`` reply is recovered one level
up (`gym_sessions.client.step_recovery`).
"""

from __future__ import annotations

import enum
import json
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from gym_sessions import compression
from gym_sessions.client.tls import default_context
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    GymSessionsError,
    ReplyTimeoutError,
    ServerUnreachableError,
    error_from_body,
    foreign_reply_error,
    unreadable_reply_error,
)
from gym_sessions.wire import SESSION_COOKIE

#: The most bytes a compressed reply may hold: a zstd reply cannot grow past it.
MAX_DECOMPRESSED_REPLY = 256 * 1024 * 1024

__all__ = [
    "EncodedBody",
    "Exchange",
    "Failure",
    "HTTPClientBase",
    "Reply",
    "Request",
    "TransportFailure",
]

#: Headers only the client sets: a caller's value would break the request's framing.
_FRAMING_HEADERS = frozenset(
    {"connection", "content-length", "content-type", "host", "transfer-encoding"}
)


class EncodedBody:
    """A request body sent as it is: its bytes and their ``Content-Type`` (a binary message)."""

    __slots__ = ("content_type", "data")

    def __init__(self, data: bytes, content_type: str) -> None:
        self.data = data
        self.content_type = content_type


@dataclass(frozen=True)
class Request:
    """One HTTP request of a session.

    Attributes:
        method: ``GET`` or ``POST``.
        path: Route path (the client adds its URL's prefix).
        body: JSON body, or an `EncodedBody`; ``None`` sends none.
        headers: Extra headers.
        resendable: Safe to send again when its reply is lost (see
            `gym_sessions.client.protocol`).
        new_session: The first start of a session: the client drops the cookie
            of an earlier (closed) session, which the server would refuse beside
            the new id (409).
        sends_cookie: Send the session cookie (a step batch names its sessions
            in its body, each with its own cookie, and must name none itself).
    """

    method: str
    path: str
    body: Any = None
    headers: Mapping[str, str] = field(default_factory=dict)
    resendable: bool = False
    new_session: bool = False
    sends_cookie: bool = True

    def describe(self) -> str:
        return f"{self.method} {self.path}"


@dataclass(frozen=True)
class Reply:
    """A reply: status, headers (lower-case names) and raw body."""

    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class Failure(enum.Enum):
    """How a send got no reply."""

    #: No connection could be made: nothing was sent.
    UNREACHABLE = "unreachable"
    #: The connection broke after the request went out: it may have run.
    LOST = "lost"
    #: No reply within the timeout: it may have run (or still be running).
    TIMEOUT = "timeout"


class TransportFailure(Exception):
    """A shell's report that a send got no reply; the library's error is its ``__cause__``.

    Never leaves the shells: `Exchange.failed` turns it into a resend or a
    `GymSessionsError`.

    Args:
        failure: What happened.
        reason: Words for the error message.
    """

    def __init__(self, failure: Failure, reason: str) -> None:
        super().__init__(reason)
        self.failure = failure
        self.reason = reason

    @classmethod
    def of(cls, failure: Failure, exc: BaseException) -> TransportFailure:
        """A failure worded after the library's exception ``exc``."""
        return cls(failure, str(exc) or type(exc).__name__)


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
    """URL, session cookie and headers of a client, and the `Exchange` of each request.

    Args:
        url: Server base URL, ``http://host:port`` or ``https://host[:port]``
            (a path prefix is kept).
        timeout: Seconds to wait for connect and for each reply.
        keep_alive: Reuse one connection (the default). ``False`` opens a new
            connection per request, as pooled clients and load balancers do.
        retries: How many times a resendable request is sent again after its
            reply was lost (a broken connection, a timeout or a 502
            ``bad_gateway``), all of them counted together.
        cookie_name: The server's session cookie name.
        headers: Extra headers sent with every request (an authenticating
            proxy's, say). A ``Cookie`` here is sent along with the session
            cookie; framing headers (``Content-Type``, ``Connection``, ...) are refused.
        ssl_context: TLS settings of an ``https://`` URL (the system's default
            by default: `gym_sessions.client.tls`); unused for ``http://``.

    Binary replies come zstd-compressed when the host is not loopback
    (``Accept-Encoding: zstd``: `gym_sessions.compression`); an
    ``Accept-Encoding`` in ``headers`` decides instead (``identity``: never).

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
        cookie_name: str = SESSION_COOKIE,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must look like http://host:port or https://host, not {url!r}")
        self.url = url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        #: TLS settings, for an ``https`` URL only.
        self.ssl_context: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self.ssl_context = ssl_context or default_context()
        self._prefix = parts.path.rstrip("/")
        self.timeout = timeout
        self.keep_alive = keep_alive
        self.retries = retries
        self.cookie_name = cookie_name
        self.cookie: str | None = None
        #: The most a compressed reply may decompress to (a pool's own bound may lower it).
        self.max_decompressed_reply = MAX_DECOMPRESSED_REPLY
        #: The caller's extra headers, sent with every request.
        self.headers = _checked_headers(headers)
        self._accept_zstd = (
            compression.available()
            and not compression.is_loopback(self._host)
            and not any(name.lower() == "accept-encoding" for name in self.headers)
        )

    def exchange(self, request: Request) -> Exchange:
        """The exchange of ``request``: what to send, and what each outcome means."""
        if request.new_session:
            self.cookie = None  # an earlier session's cookie beside the new id would get a 409
        headers = {name: value for name, value in self.headers.items() if name.lower() != "cookie"}
        if not any(name.lower() == "accept" for name in headers):
            headers["Accept"] = "application/json"
        if self._accept_zstd:
            headers["Accept-Encoding"] = compression.ENCODING
        payload = b""
        if isinstance(request.body, EncodedBody):
            payload = request.body.data
            headers["Content-Type"] = request.body.content_type
        elif request.body is not None:
            payload = json.dumps(request.body, allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        cookies = [value for name, value in self.headers.items() if name.lower() == "cookie"]
        if self.cookie and request.sends_cookie:
            cookies.append(f"{self.cookie_name}={self.cookie}")
        if cookies:  # one Cookie header: the caller's cookies and the session's
            headers["Cookie"] = "; ".join(cookies)
        if not self.keep_alive:
            headers["Connection"] = "close"
        headers.update(request.headers)
        return Exchange(self, request, payload, headers)

    def remember_cookie(self, headers: Iterable[tuple[str, str]]) -> None:
        """Keep the session cookie that reply ``headers`` set, if any."""
        for name, value in headers:
            if name.lower() == "set-cookie":
                key, _, rest = value.split(";", 1)[0].partition("=")
                if key.strip() == self.cookie_name:
                    self.cookie = rest.strip() or None


class Exchange:
    """One request from its first send to its reply or its error.

    The shell sends `method`, `path`, `payload` and `headers` (the same bytes
    every time), then reports the outcome: `replied` or `failed`.
    """

    def __init__(
        self, client: HTTPClientBase, request: Request, payload: bytes, headers: dict[str, str]
    ) -> None:
        self.client = client
        self.request = request
        self.method = request.method
        #: The route path, without the client's URL prefix.
        self.path = request.path
        self.payload = payload
        self.headers = headers
        #: Sends left after a lost reply: `HTTPClientBase.retries` if resendable, else none.
        self.resends_left = client.retries if request.resendable else 0

    def replied(self, status: int, headers: Iterable[tuple[str, str]], body: bytes) -> Reply:
        """The reply; raises the `HTTPError` an error status stands for.

        Raises:
            HTTPError: ``status`` is 400 or more (the subclass the body's code
                names), or the reply is an HTML page (another server's).
        """
        headers = list(headers)
        self.client.remember_cookie(headers)
        url, what = self.client.url, self.request.describe()
        if status >= 400:
            error = error_from_body(status, body, url=url, what=what)
            if error.code == BadGatewayError.code and self.resends_left > 0:
                # A hop behind the server lost the reply: the server's own LOST.
                # (Not `bad_upstream`: an upstream answered, unusably, and would again.)
                raise TransportFailure.of(Failure.LOST, error) from error
            raise error
        reply_headers = {name.lower(): value for name, value in headers}
        encoding = reply_headers.get("content-encoding", "identity").strip().lower()
        if encoding == compression.ENCODING and compression.available():
            try:
                body = compression.decompress(body, self.client.max_decompressed_reply)
            except ValueError as exc:
                raise unreadable_reply_error(status, str(exc), url=url, what=what) from exc
            del reply_headers["content-encoding"]
        elif encoding != "identity":
            reason = f"Content-Encoding {encoding!r}, which this client did not ask for"
            raise unreadable_reply_error(status, reason, url=url, what=what)
        reply = Reply(status, reply_headers, body)
        if reply.headers.get("content-type", "").startswith("text/html"):
            raise foreign_reply_error(status, body, url=url, what=what)  # never a reply of ours
        return reply

    def failed(self, failure: TransportFailure) -> None:
        """Return to send the request again; otherwise raise its client error (see module)."""
        if failure.failure is not Failure.UNREACHABLE and self.resends_left > 0:
            self.resends_left -= 1
            return
        raise self.error(failure) from failure.__cause__

    def error(self, failure: TransportFailure) -> GymSessionsError:
        """The client error for ``failure`` when the request is not sent again."""
        url, what = self.client.url, self.request.describe()
        if failure.failure is Failure.UNREACHABLE:
            return ServerUnreachableError(url, failure.reason)
        if failure.failure is Failure.TIMEOUT:
            return ReplyTimeoutError(url, what, self.client.timeout)
        return ConnectionLostError(url, what, failure.reason)
