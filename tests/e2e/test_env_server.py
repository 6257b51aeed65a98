"""Every route and error code of the Gymnasium adapter, through a real uvicorn server."""

from __future__ import annotations

import json
import socket
import urllib.request

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client.http import HTTPClient
from gym_sessions.errors import (
    BodyTooLargeError,
    InvalidJSONError,
    InvalidRequestError,
    MethodNotAllowedError,
    NoOpenEpisodeError,
    NotFoundError,
    ServerUnreachableError,
    SessionClosedError,
    SessionConflictError,
    StepOutOfOrderError,
)
from gym_sessions.server.process import start_server

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def counter_url():
    with start_server("envs.counter:CounterEnv") as server:
        yield server.url


def raw(url: str, method: str, path: str, data: bytes | None = None, headers=None):
    request = urllib.request.Request(url + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read()), reply.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def test_spaces_and_health(counter_url):
    status, spaces, _ = raw(counter_url, "GET", "/spaces")
    assert status == 200
    assert spaces["action_space"] == {"type": "Discrete", "n": 21, "start": -10, "dtype": "int64"}
    assert spaces["observation_space"]["type"] == "Box"
    assert spaces["metadata"]["render_modes"] == ["ansi"]
    status, health, headers = raw(counter_url, "GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["worker"]
    assert "set-cookie" not in headers


def test_full_episode_and_lifecycle_over_http(counter_url):
    client = HTTPClient(counter_url)
    start = client.request(
        "POST", "/reset", {"options": {"initial_count": 5, "expected_count": 8}, "seed": 3}
    )
    assert start["observation"] == 5 and client.cookie
    step = client.request("POST", "/step", {"action": 3})
    assert step == {
        "observation": 8,
        "reward": 0.0,
        "terminated": False,
        "truncated": False,
        "info": {},
    }
    verify = client.request("POST", "/verify", {}, headers={"x-gym-close-follows": "1"})
    assert verify["reward"] == 1.0 and verify["episode_length"] == 1
    # A reset of an open session starts a new episode on the same instance.
    again = client.request("POST", "/reset", {"options": {"initial_count": 1}})
    assert again["resources_session_id"] == start["resources_session_id"]
    assert again["observation"] == 1
    assert client.request("POST", "/close_session")["outcome"] == "closed"
    assert client.request("POST", "/close_session")["outcome"] == "already_closed"
    with pytest.raises(SessionClosedError):
        client.request("POST", "/reset", {})
    with pytest.raises(SessionClosedError):
        client.request("POST", "/step", {"action": 1})


def test_rollout_prefix_answers_every_route(counter_url):
    client = HTTPClient(counter_url + "/rollouts/run-42")
    client.request("POST", "/seed_session", {"options": {"initial_count": 2, "expected_count": 4}})
    client.request("POST", "/step", {"action": 2})
    assert client.request("POST", "/verify", {})["reward"] == 1.0
    assert client.request("GET", "/spaces")["action_space"]["n"] == 21
    metrics = client.request(
        "POST", "/aggregate_metrics", {"verify_responses": [{"reward": 1.0}, {"reward": 0.0}]}
    )
    assert metrics == {"count": 2, "mean_reward": 0.5}


@pytest.mark.parametrize(
    ("path", "body", "error", "code"),
    [
        ("/step", b"{not json", InvalidJSONError, "invalid_json"),
        ("/step", b"[1, 2]", InvalidRequestError, "invalid_request"),
        ("/step", b"{}", InvalidRequestError, "invalid_request"),
        ("/step", b'{"action": 1, "extra": 2}', InvalidRequestError, "invalid_request"),
        ("/step", b'{"action": 11}', InvalidRequestError, "invalid_request"),
        ("/step", b'{"action": "left"}', InvalidRequestError, "invalid_request"),
        ("/step", b'{"action": NaN}', InvalidJSONError, "invalid_json"),
        ("/step", b'{"action": 1e400}', InvalidRequestError, "invalid_request"),
        ("/reset", b'{"seed": -1}', InvalidRequestError, "invalid_request"),
        ("/reset", b'{"seed": "x"}', InvalidRequestError, "invalid_request"),
        ("/reset", b'{"options": 3}', InvalidRequestError, "invalid_request"),
        (
            "/reset",
            b'{"resources_session_id": "../../etc"}',
            InvalidRequestError,
            "invalid_session_id",
        ),
        ("/aggregate_metrics", b"{}", InvalidRequestError, "invalid_request"),
    ],
)
def test_bad_input_gets_its_error(counter_url, path, body, error, code):
    client = HTTPClient(counter_url)
    client.request("POST", "/reset", {})
    status, reply, _ = raw(
        counter_url,
        "POST",
        path,
        body,
        {"Cookie": f"gym_session={client.cookie}", "Content-Type": "application/json"},
    )
    assert reply["error"]["code"] == code
    assert status == error.status
    # The session is unharmed.
    assert client.request("POST", "/step", {"action": 1})["observation"] == 1


def test_unknown_route_method_and_oversized_body(counter_url):
    assert raw(counter_url, "GET", "/nope")[1]["error"]["code"] == NotFoundError.code
    assert raw(counter_url, "GET", "/step")[1]["error"]["code"] == MethodNotAllowedError.code
    # Declared too large: refused before the body is read.
    request = urllib.request.Request(
        counter_url + "/step",
        data=b"x",
        method="POST",
        headers={"Content-Length": str(65 * 1024 * 1024)},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == BodyTooLargeError.status


def test_tampered_cookie_is_treated_as_no_cookie(counter_url):
    owner = HTTPClient(counter_url)
    owner.request("POST", "/reset", {"options": {"initial_count": 7}})
    intruder = HTTPClient(counter_url)
    intruder.cookie = owner.cookie[:-4] + "AAAA"
    with pytest.raises(NoOpenEpisodeError):
        intruder.request("POST", "/step", {"action": 1})
    assert owner.request("POST", "/step", {"action": 1})["observation"] == 8


def test_a_step_runs_only_at_the_episode_length_it_was_sent_at(counter_url):
    # A send delayed in a hop may arrive after its client resent it: the later
    # of two sends at one length is refused and changes nothing.
    client = HTTPClient(counter_url)
    client.request("POST", "/reset", {"options": {"initial_count": 0}})
    at = {"x-gym-episode-length": "0"}
    assert client.request("POST", "/step", {"action": 5}, headers=at)["observation"] == 5
    with pytest.raises(StepOutOfOrderError) as refused:
        client.request("POST", "/step", {"action": 5}, headers=at)
    assert (refused.value.status, refused.value.code) == (409, "step_out_of_order")
    assert "sent at episode length 0, but the episode is at 1" in refused.value.message
    assert client.request("POST", "/observe", {}) == {"observation": 5, "episode_length": 1}
    with pytest.raises(StepOutOfOrderError):  # ahead of the episode: refused too
        client.request("POST", "/step", {"action": 1}, headers={"x-gym-episode-length": "7"})
    step = client.request("POST", "/step", {"action": 2}, headers={"x-gym-episode-length": "1"})
    assert step["observation"] == 7
    assert client.request("POST", "/step", {"action": 1})["observation"] == 8  # no header: runs
    for bad in ["-1", "1.0", "x", "\u00b2", "9" * 19, ""]:
        with pytest.raises(InvalidRequestError, match="x-gym-episode-length must be"):
            client.request("POST", "/step", {"action": 1}, headers={"x-gym-episode-length": bad})
    assert client.request("POST", "/observe", {})["episode_length"] == 3


def test_cookie_and_body_conflict_is_409_with_one_worker(counter_url):
    client = HTTPClient(counter_url)
    client.request("POST", "/reset", {})
    with pytest.raises(SessionConflictError):
        client.request("POST", "/reset", {"resources_session_id": "someone-else"})


def test_env_exception_is_500_env_error_and_worker_keeps_serving(serve):
    server = serve("tests.e2e.failing_env:FailingEnv")
    client = HTTPClient(server.url)
    client.request("POST", "/reset", {})
    status, reply, _ = raw(
        server.url,
        "POST",
        "/step",
        b'{"action": 1}',
        {"Cookie": f"gym_session={client.cookie}"},
    )
    assert status == 500
    assert reply["error"]["code"] == "env_error"
    assert "ZeroDivisionError" in reply["error"]["message"]
    assert client.request("POST", "/step", {"action": 0})["reward"] == 1.0


@pytest.mark.parametrize("target", ["CartPole-v1", "envs.counter:CounterEnv"])
def test_remote_env_passes_check_env(serve, target):
    server = serve(target)
    env = gym.make("gym_sessions/Remote-v0", url=server.url)
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


def test_remote_env_through_gymnasium_make(counter_url):
    env = gym.make("gym_sessions/Remote-v0", url=counter_url)
    obs, _ = env.reset(seed=1, options={"initial_count": 10, "expected_count": 12})
    assert obs == np.int64(10) and obs.dtype == np.int64
    obs, reward, terminated, truncated, _ = env.step(2)
    assert obs == 12 and reward == 0.0 and not terminated and not truncated
    assert env.unwrapped.verify()["reward"] == 1.0
    env.close()
    env.close()  # idempotent


def test_two_clients_never_see_each_others_state(counter_url):
    a = gym.make("gym_sessions/Remote-v0", url=counter_url)
    b = gym.make("gym_sessions/Remote-v0", url=counter_url)
    a.reset(options={"initial_count": 100})
    b.reset(options={"initial_count": -100})
    for _ in range(5):
        assert a.step(1)[0] > 100 - 1
        assert b.step(-1)[0] < -100 + 1
    assert a.step(0)[0] == 105 and b.step(0)[0] == -105
    a.close()
    b.close()


def test_connection_refused_names_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ServerUnreachableError, match=f"127.0.0.1:{port}"):
        gym.make("gym_sessions/Remote-v0", url=url)
