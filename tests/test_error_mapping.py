"""Which exception a client raises: for each error reply, each transport failure, and in the agent.

Error replies map through `gym_sessions.errors.error_from_body` (by the body's
code, else by status) at one place, `Exchange.replied`; transport failures map
at `Exchange.error`; the agent turns either into 502 (`bad_gateway`).
"""

from __future__ import annotations

import json

import pytest

from gym_sessions import errors
from gym_sessions.client.exchange import (
    Failure,
    HTTPClientBase,
    Request,
    TransportFailure,
)
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    GatewayTimeoutError,
    GymSessionsError,
    HTTPError,
    InvalidRequestError,
    NotFoundError,
    ReplyTimeoutError,
    ServerUnreachableError,
    ServiceUnavailableError,
    SessionConflictError,
    SessionGoneError,
    TooManyRequestsError,
)
from gym_sessions.server.env_session import bad_gateway

URL = "http://127.0.0.1:8000"
STEP = Request("POST", "/step", {"action": 1})

HTTP_ERRORS = sorted(
    (
        cls
        for cls in (getattr(errors, name) for name in errors.__all__)
        if isinstance(cls, type) and issubclass(cls, HTTPError) and cls is not HTTPError
    ),
    key=lambda cls: cls.code,
)


def reply_error(status: int, body: bytes, headers: list[tuple[str, str]] | None = None):
    """The exception a reply raises, or ``None`` if it is a reply."""
    exchange = HTTPClientBase(URL).exchange(STEP)
    try:
        exchange.replied(status, headers or [], body)
    except HTTPError as error:
        return error
    return None


def framework_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


@pytest.mark.parametrize("cls", HTTP_ERRORS, ids=lambda cls: cls.code)
def test_an_error_body_raises_the_class_its_code_names(cls):
    error = reply_error(cls.status, framework_body(cls.code, "why"))
    assert type(error) is cls
    assert (error.status, error.code, error.message) == (cls.status, cls.code, "why")


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, InvalidRequestError),
        (404, NotFoundError),
        (409, SessionConflictError),
        (410, SessionGoneError),
        (429, TooManyRequestsError),
        (502, BadGatewayError),
        (503, ServiceUnavailableError),
        (504, GatewayTimeoutError),
    ],
)
def test_a_body_not_in_the_framework_format_maps_by_status_and_says_so(status, cls):
    error = reply_error(status, b"<html>proxy says no</html>")
    assert type(error) is cls
    assert error.message.startswith(f"POST /step to {URL}: HTTP {status} ")
    assert "with an HTML page, not a gym-sessions reply" in error.message
    assert "proxy says no" not in error.message


def test_a_503_page_is_never_one_of_the_servers_own_503s():
    # Which 503 the server meant is only in its body: a page says none of them.
    error = reply_error(503, b"<html>503 Service Temporarily Unavailable</html>")
    assert type(error) is ServiceUnavailableError and error.code == "service_unavailable"
    for code in ("claims_unavailable", "capacity_reached", "overloaded", "not_ready"):
        ours = reply_error(503, framework_body(code, "why"))
        assert isinstance(ours, ServiceUnavailableError) and ours.code == code


def test_an_unknown_status_is_a_plain_http_error_with_that_status():
    error = reply_error(418, b"")
    assert type(error) is HTTPError
    assert (error.status, error.code) == (418, "unexpected_reply")
    assert "HTTP 418 I'm a Teapot with an empty body" in error.message


def test_an_html_page_is_an_error_whatever_its_status():
    error = reply_error(200, b"<!doctype html><p>Welcome</p>", [("Content-Type", "text/html")])
    assert type(error) is HTTPError
    assert (error.status, error.code) == (200, "unexpected_reply")
    assert "not a gym-sessions reply" in error.message


def test_the_code_wins_over_the_status_and_the_status_is_kept():
    error = reply_error(502, framework_body("session_gone", "worker exited"))
    assert type(error) is SessionGoneError
    assert error.status == 502


def test_a_short_text_is_quoted_cut_and_other_bodies_only_described():
    assert "with the text 'no upstream'" in reply_error(500, b"no upstream\nmore").message
    assert "'" + "x" * 120 + "'" in reply_error(500, b"x" * 10_000).message
    assert "with a JSON body," in reply_error(500, b'{"detail": "Not Found"}').message
    assert "with a 4-byte body," in reply_error(500, b"\x00\x01\x02\x03").message


@pytest.mark.parametrize("status", [200, 204, 302, 399])
def test_statuses_below_400_are_replies(status):
    assert reply_error(status, b"{}") is None


def test_an_error_reply_still_sets_the_session_cookie():
    http = HTTPClientBase(URL)
    with pytest.raises(SessionConflictError):
        http.exchange(STEP).replied(
            409, [("set-cookie", "gym_session=abc")], framework_body("session_conflict", "")
        )
    assert http.cookie == "abc"


# Transport failures --------------------------------------------------------------------------


def raised_for(failure: Failure, request: Request = STEP) -> GymSessionsError:
    cause = OSError("the library's own error")
    reported = TransportFailure(failure, "connection reset")
    reported.__cause__ = cause
    exchange = HTTPClientBase(URL, timeout=2.5, retries=0).exchange(request)
    with pytest.raises(GymSessionsError) as raised:
        exchange.failed(reported)
    assert raised.value.__cause__ is cause
    return raised.value


def test_an_unreachable_server_raises_server_unreachable_naming_the_url():
    error = raised_for(Failure.UNREACHABLE)
    assert type(error) is ServerUnreachableError
    assert str(error) == f"cannot reach gym-sessions server at {URL}: connection reset"
    assert isinstance(error, ConnectionError)


def test_a_lost_reply_raises_connection_lost_naming_the_request():
    error = raised_for(Failure.LOST)
    assert type(error) is ConnectionLostError
    assert str(error) == f"POST /step to {URL}: connection reset"


def test_a_missing_reply_raises_reply_timeout_naming_the_request_and_timeout():
    error = raised_for(Failure.TIMEOUT)
    assert type(error) is ReplyTimeoutError
    assert str(error) == f"no reply to POST /step from {URL} within 2.5 s"
    assert isinstance(error, TimeoutError)


# The agent's env sessions --------------------------------------------------------------------


def test_the_agent_names_the_env_server_route_status_and_code_of_an_error_reply():
    # The upstream's message is never reflected (issue 33): status and code only.
    error = bad_gateway(URL, "/step", reply_error(500, framework_body("env_error", "it broke")))
    assert type(error) is BadGatewayError
    assert error.message == f"env server {URL} answered /step with 500 env_error"


def test_the_agent_names_the_env_server_route_and_cause_of_a_transport_failure():
    error = bad_gateway(URL, "/spaces", raised_for(Failure.UNREACHABLE))
    assert type(error) is BadGatewayError
    assert error.message.startswith(f"env server {URL} failed on /spaces: cannot reach")
