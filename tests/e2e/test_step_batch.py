"""``POST /step_batch`` against real 4-worker servers: results, the ownership rule, bounds.

Every request here goes over a new connection (``urllib``), so it lands on any
worker: batches mix entries held by several workers, and the accepting worker
sends each holder its sub-batch. Sessions are started with ``/reset`` naming
their id and a ``session_key``; the reply's cookie is each entry's credential.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request
import uuid
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.credentials import INCARNATION_KEY, SessionCredentials
from gym_sessions.routing.step_batch import MAX_BATCH_ENTRIES
from gym_sessions.server.process import start_server
from tests.services import claim_owner

pytestmark = pytest.mark.e2e

SECRET = "step-batch-secret-" + "s" * 24
CREDENTIALS = SessionCredentials(SECRET, "gym_session")
OTHER_SERVER = SessionCredentials("another-servers-secret-" + "o" * 24, "gym_session")
COUNTER = "envs.counter:CounterEnv"
MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def counter_url():
    with start_server(
        COUNTER, "--max-body-bytes", str(MAX_BODY), workers=4, secret=SECRET
    ) as server:
        yield server.url


@pytest.fixture(scope="module")
def cartpole_url():
    with start_server("CartPole-v1", workers=4, secret=SECRET) as server:
        yield server.url


def call(
    url: str, method: str, path: str, body: Any = None, *, cookie: str | None = None, raw=None
) -> tuple[int, Any]:
    """One request over a new connection; the status and the parsed JSON reply."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if cookie is not None:
        request.add_header("Cookie", f"gym_session={cookie}")
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def start(url: str, **body: Any) -> tuple[str, str]:
    """Start a session; its id and the cookie value its reply set."""
    sid = uuid.uuid4().hex
    data = json.dumps({"resources_session_id": sid, "session_key": "k" * 32, **body}).encode()
    request = urllib.request.Request(url + "/reset", data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
        cookie = reply.headers["set-cookie"].split(";", 1)[0].partition("=")[2]
    return sid, cookie


def batch(url: str, entries: list[dict[str, Any]], path: str = "/step_batch") -> list[dict]:
    status, reply = call(url, "POST", path, {"entries": entries})
    assert status == 200, reply
    assert len(reply["results"]) == len(entries)
    return reply["results"]


def episode_length(url: str, cookie: str) -> int:
    status, reply = call(url, "POST", "/observe", {}, cookie=cookie)
    assert status == 200, reply
    return reply["episode_length"]


def holder(url: str, cookie: str) -> str:
    status, reply = call(url, "GET", "/health", cookie=cookie)
    assert status == 200
    return reply["worker"]


def strip_worker(result: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in result.items() if key != "worker"}


# ----------------------------------------------------------------------------- results


def test_spaces_offers_the_batch_route(counter_url):
    status, spaces = call(counter_url, "GET", "/spaces")
    assert status == 200
    assert spaces["step_batch"] == {"path": "/step_batch", "max_entries": MAX_BATCH_ENTRIES}


def test_batch_results_equal_single_steps_and_name_each_holder(cartpole_url):
    seeds = list(range(12))
    batched = [start(cartpole_url, seed=seed) for seed in seeds]
    single = [start(cartpole_url, seed=seed) for seed in seeds]
    rng = np.random.default_rng(0)
    for _ in range(15):
        actions = rng.integers(0, 2, size=len(seeds)).tolist()
        results = batch(
            cartpole_url,
            [{"cookie": c, "action": a} for (_, c), a in zip(batched, actions, strict=True)],
        )
        for (_, cookie), action, result in zip(single, actions, results, strict=True):
            status, alone = call(cartpole_url, "POST", "/step", {"action": action}, cookie=cookie)
            if status != 200:  # the episode ended on an earlier step: so did the batched one
                assert result["status"] == status and result["error"] == alone["error"]
                continue
            assert strip_worker(result) == alone
    workers = [result["worker"] for result in results]
    assert workers == [holder(cartpole_url, cookie) for _, cookie in batched]
    assert len(set(workers)) >= 2  # the batch crossed workers


def test_vector_env_steps_the_same_with_and_without_batches(cartpole_url):
    def run(step_batch: bool) -> list[Any]:
        envs = gym.make_vec(
            "gym_sessions/Remote-v0",
            num_envs=8,
            url=cartpole_url,
            step_batch=step_batch,
            autoreset_mode="SameStep",
        )
        try:
            assert (envs.unwrapped.step_batch is not None) is step_batch
            out: list[Any] = [envs.reset(seed=7)[0].tolist()]
            rng = np.random.default_rng(1)
            for _ in range(60):
                obs, rew, term, trunc, info = envs.step(rng.integers(0, 2, size=8))
                final = info.get("final_obs")
                out.append(
                    (
                        obs.tolist(),
                        rew.tolist(),
                        term.tolist(),
                        trunc.tolist(),
                        None
                        if final is None
                        else [None if f is None else f.tolist() for f in final],
                    )
                )
            return out
        finally:
            envs.close()

    assert run(True) == run(False)


# ----------------------------------------------------------------------------- ownership


def test_entries_that_fail_their_check_change_nothing_and_the_others_step(counter_url):
    (_, cookie_a), (sid_b, cookie_b) = start(counter_url), start(counter_url)
    (sid_c, cookie_c) = start(counter_url)
    _, closed_cookie = start(counter_url)
    status, _ = call(counter_url, "POST", "/close_session", {}, cookie=closed_cookie)
    assert status == 200
    # Signed with the server's secret but for another incarnation of B: another
    # client's cookie, which the ownership rule refuses.
    stale = CREDENTIALS.encode_cookie({"session_id": sid_b, INCARNATION_KEY: "not-b's-nonce"})
    # Names C, signed by another server: no session at all here.
    foreign = OTHER_SERVER.encode_cookie({"session_id": sid_c, INCARNATION_KEY: "x"})
    tampered = cookie_c[:-2] + ("AA" if not cookie_c.endswith("AA") else "BB")
    nobody = CREDENTIALS.encode_cookie({"session_id": uuid.uuid4().hex, INCARNATION_KEY: "y"})
    results = batch(
        counter_url,
        [
            {"cookie": cookie_a, "action": 2},
            {"cookie": stale, "action": 5},
            {"cookie": foreign, "action": 5},
            {"cookie": tampered, "action": 5},
            {"cookie": closed_cookie, "action": 5},
            {"cookie": nobody, "action": 5},
            {"cookie": cookie_c, "action": 99},  # outside Discrete(21, start=-10)
        ],
    )
    assert results[0]["observation"] == 2
    codes = [(r.get("status"), r.get("error", {}).get("code")) for r in results[1:]]
    assert codes == [
        (409, "session_conflict"),
        (404, "no_open_episode"),
        (404, "no_open_episode"),
        (409, "session_closed"),
        (404, "no_open_episode"),
        (400, "invalid_request"),
    ]
    # Nothing of B or C moved; A stepped once.
    assert episode_length(counter_url, cookie_b) == 0
    assert episode_length(counter_url, cookie_c) == 0
    assert episode_length(counter_url, cookie_a) == 1
    # B and C still step with their own cookies, in a batch and alone.
    again = batch(
        counter_url, [{"cookie": cookie_b, "action": 1}, {"cookie": cookie_c, "action": -1}]
    )
    assert [r["observation"] for r in again] == [1, -1]


def test_an_entry_runs_only_at_the_episode_length_it_was_sent_at(counter_url):
    # As /step's x-gym-episode-length: a late first send after its resend changes nothing.
    (_, a), (_, b) = start(counter_url), start(counter_url)
    first = batch(
        counter_url,
        [{"cookie": a, "action": 2, "episode_length": 0}, {"cookie": b, "action": 3}],
    )
    assert [r["observation"] for r in first] == [2, 3]
    again = batch(
        counter_url,
        [
            {"cookie": a, "action": 2, "episode_length": 0},
            {"cookie": b, "action": 1, "episode_length": 1},
        ],
    )
    assert (again[0]["status"], again[0]["error"]["code"]) == (409, "step_out_of_order")
    assert again[1]["observation"] == 4
    assert episode_length(counter_url, a) == 1 and episode_length(counter_url, b) == 2


def test_a_session_named_twice_is_refused_whole(counter_url):
    _, cookie = start(counter_url)
    status, reply = call(
        counter_url,
        "POST",
        "/step_batch",
        {"entries": [{"cookie": cookie, "action": 1}, {"cookie": cookie, "action": 1}]},
    )
    assert (status, reply["error"]["code"]) == (400, "invalid_request")
    assert "name the same session" in reply["error"]["message"]
    assert episode_length(counter_url, cookie) == 0


def test_a_gone_holder_fails_its_entries_only(serve):
    server = serve(COUNTER, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    sessions = [start(server.url) for _ in range(12)]
    owners = [claim_owner(runtime_dir, sid) for sid, _ in sessions]
    victim = owners[0]
    assert victim is not None and len(set(owners)) >= 2
    os.kill(int(victim.split("-")[0]), signal.SIGKILL)
    results = batch(server.url, [{"cookie": c, "action": 3} for _, c in sessions])
    for owner, result in zip(owners, results, strict=True):
        if owner == victim:
            assert (result["status"], result["error"]["code"]) == (410, "session_gone")
        else:
            assert result["observation"] == 3 and result["worker"] == owner


# ----------------------------------------------------------------------------- bounds and bad input


def test_an_oversized_batch_is_413(counter_url):
    _, cookie = start(counter_url)
    entries = [{"cookie": cookie, "action": 1}] * (MAX_BODY // len(cookie) + 1)
    status, reply = call(counter_url, "POST", "/step_batch", {"entries": entries})
    assert (status, reply["error"]["code"]) == (413, "body_too_large")
    short = [{"cookie": "c", "action": 1}] * (MAX_BATCH_ENTRIES + 1)
    status, reply = call(counter_url, "POST", "/step_batch", {"entries": short})
    assert (status, reply["error"]["code"]) == (413, "body_too_large")
    assert f"at most {MAX_BATCH_ENTRIES} entries" in reply["error"]["message"]
    assert episode_length(counter_url, cookie) == 0


BAD_BODIES = [
    (b"{oops", 400, "invalid_json"),
    (b'{"entries": [{"cookie": "c", "action": NaN}]}', 400, "invalid_json"),
    (b"", 400, "invalid_request"),
    (b"[]", 400, "invalid_request"),
    (b'"entries"', 400, "invalid_request"),
    (b"{}", 400, "invalid_request"),
    (b'{"entries": []}', 400, "invalid_request"),
    (b'{"entries": {}}', 400, "invalid_request"),
    (b'{"entries": [1]}', 400, "invalid_request"),
    (b'{"entries": [{"action": 1}]}', 400, "invalid_request"),
    (b'{"entries": [{"cookie": "c"}]}', 400, "invalid_request"),
    (b'{"entries": [{"cookie": 5, "action": 1}]}', 400, "invalid_request"),
    (b'{"entries": [{"cookie": "", "action": 1}]}', 400, "invalid_request"),
    (b'{"entries": [{"cookie": "c", "action": 1, "x": 1}]}', 400, "invalid_request"),
    (b'{"entries": [{"cookie": "c", "action": 1}], "more": 1}', 400, "invalid_request"),
    *[
        (
            b'{"entries": [{"cookie": "c", "action": 1, "episode_length": %s}]}' % n,
            400,
            "invalid_request",
        )
        for n in (b"-1", b"1.0", b"true", b'"1"', b"1e3")
    ],
]


@pytest.mark.parametrize(("body", "status", "code"), BAD_BODIES)
def test_bad_batch_bodies(counter_url, body, status, code):
    got, reply = call(counter_url, "POST", "/step_batch", raw=body)
    assert (got, reply["error"]["code"]) == (status, code)


def test_bad_entry_values_are_per_entry_errors(counter_url):
    _, cookie = start(counter_url)
    results = batch(
        counter_url,
        [
            {"cookie": "not-a-cookie", "action": 1},
            {"cookie": cookie, "action": "one"},
            {"cookie": cookie + "x", "action": 1},
        ],
    )
    assert [(r["status"], r["error"]["code"]) for r in results] == [
        (404, "no_open_episode"),
        (400, "invalid_request"),
        (404, "no_open_episode"),
    ]
    assert episode_length(counter_url, cookie) == 0


def test_methods_prefix_and_session_cookie_of_the_batch_itself(counter_url):
    status, reply = call(counter_url, "GET", "/step_batch")
    assert (status, reply["error"]["code"]) == (405, "method_not_allowed")
    _, cookie = start(counter_url)
    assert (
        batch(counter_url, [{"cookie": cookie, "action": 4}], "/rollouts/r-1/step_batch")[0][
            "observation"
        ]
        == 4
    )
    # A cookie on the batch request itself names nothing: entries carry their own.
    _, other = start(counter_url)
    status, reply = call(
        counter_url,
        "POST",
        "/step_batch",
        {"entries": [{"cookie": cookie, "action": 1}]},
        cookie=other,
    )
    assert status == 200 and reply["results"][0]["observation"] == 5
    assert episode_length(counter_url, other) == 0


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(
        st.fixed_dictionaries({"cookie": st.text(min_size=1, max_size=40), "action": JSON}),
        min_size=1,
        max_size=5,
    )
    | JSON
)
def test_any_batch_gets_a_json_answer_and_no_session_moves(counter_url, entries):
    _, cookie = start(counter_url)
    status, reply = call(counter_url, "POST", "/step_batch", {"entries": entries})
    assert status in (200, 400), reply
    if status == 200:
        assert all(r["status"] in (400, 404) for r in reply["results"])
    else:
        assert reply["error"]["code"] == "invalid_request"
    assert episode_length(counter_url, cookie) == 0


def test_batches_are_counted_under_their_own_route(counter_url):
    _, cookie = start(counter_url)
    batch(counter_url, [{"cookie": cookie, "action": 1}])
    with urllib.request.urlopen(counter_url + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    assert 'route="/step_batch"' in text


# ----------------------------------------------------------------------------- placement


@pytest.fixture(scope="module")
def balanced_url():
    with start_server(COUNTER, "--placement", "balanced", workers=4, secret=SECRET) as server:
        yield server.url


def test_a_vector_envs_groups_each_start_on_one_worker_under_balanced_placement(balanced_url):
    # Balanced placement sends each new session's start to the least busy
    # worker; a group's later starts ask to start beside its leader
    # (x-gym-start-beside), so every group shares a worker and one batch steps it.
    envs = gym.make_vec("gym_sessions/Remote-v0", num_envs=24, url=balanced_url, batch_group_size=6)
    try:
        envs.reset()
        envs.step(np.zeros(24, dtype=np.int64))
        workers = envs.unwrapped.workers
        groups = [set(workers[k : k + 6]) for k in range(0, 24, 6)]
        assert all(len(group) == 1 and None not in group for group in groups), groups
    finally:
        envs.close()


@pytest.mark.parametrize("beside", ["", "not-a-cookie", "e30.aaaa.bbbb"])
def test_a_start_beside_a_cookie_that_is_not_valid_is_placed_as_any_other(balanced_url, beside):
    sid = uuid.uuid4().hex
    data = json.dumps({"resources_session_id": sid}).encode()
    request = urllib.request.Request(balanced_url + "/reset", data=data, method="POST")
    request.add_header("Content-Type", "application/json")
    request.add_header("x-gym-start-beside", beside)
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200
