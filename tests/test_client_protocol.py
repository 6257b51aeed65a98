"""The clients' rules without I/O: the bytes of a request, when to resend, how a lost step recovers.

`gym_sessions.client.exchange` (one request: bytes, resends), the session's
requests (`gym_sessions.client.protocol`) and `StepRecovery`
(`gym_sessions.client.step_recovery`) are driven here by hand, reply by reply
and failure by failure, as the shells drive them over sockets.
"""

from __future__ import annotations

import contextlib
import json

import gymnasium as gym
import pytest

from gym_sessions.client.exchange import (
    Failure,
    HTTPClientBase,
    Reply,
    Request,
    TransportFailure,
)
from gym_sessions.client.protocol import (
    SPACES_REQUEST,
    EnvDescription,
    RemoteEnvProtocol,
    step_request,
)
from gym_sessions.client.step_recovery import OBSERVE_REQUEST, StepRecovery
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    EnvError,
    GymSessionsError,
    NoOpenEpisodeError,
    ReplyTimeoutError,
    ServerUnreachableError,
    SessionGoneError,
    StepOutOfOrderError,
)
from gym_sessions.spaces import space_to_json

URL = "http://127.0.0.1:8000"


def client(**kwargs) -> HTTPClientBase:
    return HTTPClientBase(URL, **kwargs)


def protocol(render_mode: str | None = None) -> RemoteEnvProtocol:
    served = {
        "observation_space": space_to_json(gym.spaces.Discrete(100)),
        "action_space": space_to_json(gym.spaces.Discrete(10)),
        "metadata": {"render_modes": ["rgb_array", "human"]},
    }
    return RemoteEnvProtocol(EnvDescription.from_json(served), render_mode)


def client_headers(http: HTTPClientBase, request: Request) -> dict[str, str]:
    return http.exchange(request).headers


def ok(data: object) -> Reply:
    return Reply(200, {"content-type": "application/json"}, json.dumps(data).encode())


# Request bytes --------------------------------------------------------------------------------


def test_a_json_body_is_strict_json_with_its_content_type():
    exchange = client().exchange(Request("POST", "/step", {"action": [1.5, 2]}))
    assert (exchange.method, exchange.path) == ("POST", "/step")
    assert json.loads(exchange.payload) == {"action": [1.5, 2]}
    assert exchange.headers["Content-Type"] == "application/json"
    assert exchange.headers["Accept"] == "application/json"
    with pytest.raises(ValueError, match="JSON compliant"):
        client().exchange(Request("POST", "/step", {"action": float("nan")}))


def test_a_request_without_body_sends_no_bytes_and_no_content_type():
    exchange = client().exchange(SPACES_REQUEST)
    assert exchange.payload == b""
    assert "Content-Type" not in exchange.headers


def test_the_session_cookie_goes_with_the_callers_cookies_in_one_header():
    http = client(headers={"Cookie": "proxy=1", "X-Proxy-Auth": "t", "Accept": "text/plain"})
    http.remember_cookie([("Set-Cookie", "gym_session=abc; Path=/; HttpOnly")])
    headers = client_headers(http, Request("GET", "/health"))
    assert headers["Cookie"] == "proxy=1; gym_session=abc"
    assert headers["X-Proxy-Auth"] == "t"
    assert headers["Accept"] == "text/plain"  # the caller's Accept is kept


def test_only_the_session_cookie_is_remembered_and_an_empty_one_clears_it():
    http = client()
    http.remember_cookie([("set-cookie", "other=x"), ("SET-COOKIE", "gym_session=abc; Path=/")])
    assert http.cookie == "abc"
    http.remember_cookie([("content-type", "application/json")])
    assert http.cookie == "abc"
    http.remember_cookie([("set-cookie", "gym_session=; Max-Age=0")])
    assert http.cookie is None


def test_a_sessions_first_start_drops_an_earlier_sessions_cookie():
    http = client()
    http.cookie = "old"
    assert "Cookie" in client_headers(http, Request("POST", "/reset", {}))
    assert "Cookie" not in client_headers(http, Request("POST", "/reset", {}, new_session=True))
    assert http.cookie is None


def test_without_keep_alive_every_request_asks_to_close_and_request_headers_win():
    headers = client_headers(
        client(keep_alive=False), Request("POST", "/verify", {}, {"x-gym-close-follows": "1"})
    )
    assert headers["Connection"] == "close"
    assert headers["x-gym-close-follows"] == "1"


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({"Content-Type": "text/plain"}, ValueError),
        ({"host": "x"}, ValueError),
        ({"X-A": "a\r\nX-B: b"}, ValueError),
        ({"X-A": 1}, TypeError),
    ],
)
def test_headers_the_client_sets_itself_or_that_break_framing_are_refused(headers, error):
    with pytest.raises(error):
        client(headers=headers)


@pytest.mark.parametrize("url", ["ftp://h", "h:8000", "http://", "https://"])
def test_urls_other_than_http_and_https_are_refused(url):
    with pytest.raises(ValueError, match="http://host:port or https://host"):
        HTTPClientBase(url)


def test_an_https_url_gets_port_443_and_a_verifying_tls_context_by_default():
    tls = HTTPClientBase("https://h/prefix")
    assert (tls._host, tls._port, tls._prefix) == ("h", 443, "/prefix")
    assert tls.ssl_context is not None and tls.ssl_context.check_hostname
    assert HTTPClientBase("http://h").ssl_context is None


# Resends after a lost reply -------------------------------------------------------------------


RESENDABLE = Request("POST", "/observe", {}, resendable=True)
NOT_RESENDABLE = Request("POST", "/step", {"action": 1})


def failures_until_raised(http: HTTPClientBase, request: Request, failure: Failure) -> int:
    """How many times ``request`` is sent when every send fails with ``failure``."""
    exchange = http.exchange(request)
    sends = 1
    while True:
        try:
            exchange.failed(TransportFailure(failure, "boom"))
        except GymSessionsError:
            return sends
        sends += 1


@pytest.mark.parametrize("failure", [Failure.LOST, Failure.TIMEOUT])
@pytest.mark.parametrize("retries", [0, 1, 3])
def test_a_resendable_request_is_sent_retries_more_times_after_a_lost_reply(failure, retries):
    http = client(retries=retries)
    assert failures_until_raised(http, RESENDABLE, failure) == 1 + retries


@pytest.mark.parametrize("failure", [Failure.LOST, Failure.TIMEOUT])
def test_a_request_that_is_not_resendable_is_sent_once(failure):
    assert failures_until_raised(client(retries=5), NOT_RESENDABLE, failure) == 1


@pytest.mark.parametrize("request_", [RESENDABLE, NOT_RESENDABLE])
def test_an_unreachable_server_is_never_retried(request_):
    assert failures_until_raised(client(retries=5), request_, Failure.UNREACHABLE) == 1


def test_each_request_has_its_own_retries():
    http = client(retries=1)
    assert failures_until_raised(http, RESENDABLE, Failure.LOST) == 2
    assert failures_until_raised(http, RESENDABLE, Failure.LOST) == 2


def test_a_reply_after_a_resend_is_the_reply():
    exchange = client().exchange(RESENDABLE)
    exchange.failed(TransportFailure(Failure.LOST, "reset by peer"))
    reply = exchange.replied(200, [("Content-Type", "application/json")], b'{"a": 1}')
    assert reply.json() == {"a": 1}
    assert reply.headers == {"content-type": "application/json"}


# The session's requests -----------------------------------------------------------------------


def test_which_routes_are_resendable():
    env = protocol("rgb_array")
    start = env.reset_request(seed=1, options=None)
    assert start.resendable and start.new_session
    assert env.health_request().resendable
    assert env.render_request().resendable
    assert OBSERVE_REQUEST.resendable
    assert SPACES_REQUEST.resendable
    assert not env.step_recovery(3).step.resendable
    assert not env.verify_request(True, {}).resendable
    assert env.claim_close().resendable


def test_a_start_names_the_session_and_proves_its_ownership():
    env = protocol("rgb_array")
    start = env.reset_request(seed=7, options={"a": 1})
    assert (start.method, start.path) == ("POST", "/reset")
    assert start.body == {
        "resources_session_id": env.session_id,
        "session_key": env.session_key,
        "seed": 7,
        "options": {"a": 1},
        "render_mode": "rgb_array",
    }
    again = env.reset_request(seed=None, options=None)
    assert not again.new_session  # a later reset keeps the session's cookie
    assert again.body["resources_session_id"] == env.session_id
    assert "render_mode" not in protocol().reset_request(None, None).body


def test_a_step_carries_its_action_as_json_and_counts_the_episode():
    env = protocol()
    env.reset_reply(ok({"observation": 5, "info": {}}))
    recovery = env.step_recovery(3)
    assert (recovery.step.path, recovery.step.body) == ("/step", {"action": 3})
    reply = {"observation": 6, "reward": 1.0, "terminated": False, "truncated": False, "info": {}}
    assert env.step_reply(ok(reply))[0] == 6
    assert env.step_recovery(3).episode_length == 1
    env.reset_reply(ok({"observation": 0, "info": {}}))
    assert env.step_recovery(3).episode_length == 0


def test_verify_says_whether_a_close_follows():
    env = protocol()
    assert env.verify_request(True, {"x": 1}).headers == {"x-gym-close-follows": "1"}
    assert env.verify_request(False, {}).headers == {}
    assert env.verify_request(True, {"x": 1}).body == {"x": 1}


def test_a_session_is_closed_once_and_only_if_it_started():
    assert protocol().claim_close() is None  # never started: nothing to close
    env = protocol()
    env.reset_request(None, None)
    close = env.claim_close()
    assert close.path == "/close_session"
    assert close.body == {"resources_session_id": env.session_id, "session_key": env.session_key}
    assert env.claim_close() is None


def test_a_reset_after_close_starts_a_new_session():
    env = protocol()
    env.reset_request(None, None)
    old = (env.session_id, env.session_key)
    env.claim_close()
    start = env.reset_request(None, None)
    assert (env.session_id, env.session_key) != old
    assert start.new_session
    assert start.body["resources_session_id"] == env.session_id


def test_a_render_mode_the_server_cannot_send_is_refused():
    with pytest.raises(ValueError, match="render_mode='human'"):
        protocol("human")
    with pytest.raises(ValueError, match="not one of"):
        protocol("ansi")


# Step recovery --------------------------------------------------------------------------------


STEP = Request("POST", "/step", {"action": 1})
LOST = ConnectionLostError(URL, "POST /step", "Server disconnected")


def observed(episode_length: int) -> Reply:
    return ok({"observation": 0, "episode_length": episode_length})


def test_a_step_reply_ends_the_step():
    recovery = StepRecovery(STEP, episode_length=4)
    assert recovery.request is STEP
    recovery.replied(ok({"reward": 1}))
    assert recovery.request is None
    assert recovery.reply.json() == {"reward": 1}


def test_a_lost_step_that_did_not_run_is_sent_again_once():
    recovery = StepRecovery(STEP, episode_length=4)
    recovery.failed(LOST)
    assert recovery.request is OBSERVE_REQUEST
    recovery.replied(observed(4))  # the episode did not move: the step never ran
    assert recovery.request is STEP
    recovery.replied(ok({"reward": 1}))
    assert recovery.request is None
    assert recovery.reply.json() == {"reward": 1}


def test_a_lost_step_that_ran_says_so():
    recovery = StepRecovery(STEP, episode_length=4)
    recovery.failed(LOST)
    with pytest.raises(ConnectionLostError, match="the step ran on the server") as raised:
        recovery.replied(observed(5))
    assert raised.value.__cause__ is LOST


def test_a_lost_step_that_ended_the_episode_says_it_ran():
    recovery = StepRecovery(STEP, episode_length=4)
    recovery.failed(LOST)
    gone = NoOpenEpisodeError("the episode has ended: call /reset to start a new one")
    with pytest.raises(ConnectionLostError, match="the step ran on the server") as raised:
        recovery.failed(gone)
    assert raised.value.__cause__ is gone


@pytest.mark.parametrize(
    "error",
    [
        ReplyTimeoutError(URL, "POST /step", 1.0),  # may still be running: asking cannot tell
        ServerUnreachableError(URL, "refused"),
        EnvError("boom"),
        NoOpenEpisodeError("call /reset first"),
        SessionGoneError("worker exited"),
        StepOutOfOrderError("another client stepped first"),  # not a recovery: it did not run
    ],
)
def test_other_step_errors_are_raised_as_they_come(error):
    recovery = StepRecovery(STEP, episode_length=0)
    with pytest.raises(type(error)) as raised:
        recovery.failed(error)
    assert raised.value is error


@pytest.mark.parametrize(
    "error",
    [
        ConnectionLostError(URL, "POST /observe", "again"),
        ReplyTimeoutError(URL, "POST /observe", 1.0),
        SessionGoneError("worker exited"),
    ],
)
def test_a_failed_observe_is_raised_as_it_comes(error):
    recovery = StepRecovery(STEP, episode_length=0)
    recovery.failed(LOST)
    with pytest.raises(type(error)) as raised:
        recovery.failed(error)
    assert raised.value is error


@pytest.mark.parametrize("ran", [False, True])
def test_a_step_whose_hop_broke_recovers_as_a_lost_one(ran):
    # 502: the worker that took the step passed it to the session's holder,
    # which died before answering (a durable session is restored next).
    broken = BadGatewayError("the worker that held this session exited while serving it")
    recovery = StepRecovery(STEP, episode_length=4)
    recovery.failed(broken)
    assert recovery.request is OBSERVE_REQUEST
    if ran:
        with pytest.raises(ConnectionLostError, match="the step ran on the server") as raised:
            recovery.replied(observed(5))
        assert raised.value.__cause__ is broken
        assert str(raised.value).startswith("POST /step to the server: ")
    else:
        recovery.replied(observed(4))
        assert recovery.request is STEP
        recovery.replied(ok({"reward": 1}))
        assert recovery.reply.json() == {"reward": 1}


def test_a_resend_refused_as_out_of_order_says_the_first_send_ran():
    # The /observe came before the first send, delayed in a dying hop, ran.
    recovery = StepRecovery(STEP, episode_length=4)
    recovery.failed(LOST)
    recovery.replied(observed(4))
    assert recovery.request is STEP
    late = StepOutOfOrderError("sent at episode length 4, but the episode is at 5")
    with pytest.raises(ConnectionLostError, match="the step ran on the server") as raised:
        recovery.failed(late)
    assert raised.value.__cause__ is late


def _ran_after(finish) -> int:
    """How often ``on_ran`` was called when ``finish`` ends a lost step's recovery."""
    calls: list[int] = []
    recovery = StepRecovery(STEP, episode_length=4, on_ran=lambda: calls.append(1))
    recovery.failed(LOST)
    ran = ConnectionLostError  # raised when it ran; an answered resend raises nothing
    with contextlib.suppress(ran):
        finish(recovery)
    return len(calls)


def _resend_out_of_order(recovery: StepRecovery) -> None:
    recovery.replied(observed(4))
    recovery.failed(StepOutOfOrderError("the first send ran"))


def _resend_answered(recovery: StepRecovery) -> None:
    recovery.replied(observed(4))
    recovery.replied(ok({"reward": 1}))


def test_a_step_found_to_have_run_moves_the_callers_count_on_once():
    # Its next step is sent at the length the server has, or it would be refused.
    assert _ran_after(lambda r: r.replied(observed(5))) == 1
    assert _ran_after(lambda r: r.failed(NoOpenEpisodeError("the episode has ended"))) == 1
    assert _ran_after(_resend_out_of_order) == 1
    assert _ran_after(_resend_answered) == 0  # the caller counts the reply itself


def test_a_step_request_carries_the_episode_length_it_is_sent_at():
    request = step_request(3, 17)
    assert (request.path, request.body) == ("/step", {"action": 3})
    assert request.headers == {"x-gym-episode-length": "17"} and not request.resendable


def test_a_resent_step_is_not_recovered_again():
    recovery = StepRecovery(STEP, episode_length=0)
    recovery.failed(LOST)
    recovery.replied(observed(0))
    again = ConnectionLostError(URL, "POST /step", "lost twice")
    with pytest.raises(ConnectionLostError) as raised:
        recovery.failed(again)
    assert raised.value is again
