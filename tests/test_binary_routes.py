"""Space values through the routes in both encodings, in process (docs/design.md §3.15).

A real one-worker `WorkerApp` (router, cookie, routes, adapter) serves an env
that records what it produced and received; the requests are the clients' own
(`RemoteEnvProtocol`, `HTTPClientBase.exchange`) handed to the app as uvicorn
would hand them (`tests.asgi`), and the replies are decoded by the clients'
code. So every byte but the socket's is the real path, in JSON and in binary.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import pickle
import struct
from collections.abc import AsyncIterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.spaces import Box, Discrete, Space
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from envs.counter import CounterEnv
from gym_sessions.client.exchange import EncodedBody, HTTPClientBase, Reply, Request
from gym_sessions.client.protocol import (
    EnvDescription,
    RemoteEnvProtocol,
    batch_request,
    batch_results,
    reply_fields,
)
from gym_sessions.server.app import WorkerApp
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.settings import Settings
from gym_sessions.spaces import value_from_json, value_to_json
from gym_sessions.spaces.binary import frame, value_to_tree
from gym_sessions.value_messages import (
    BINARY_ACCEPT,
    BINARY_MEDIA_TYPE,
    STEP_BODY,
    BinaryValue,
    SpaceValue,
    encode_message,
)
from tests.asgi import asgi_request
from tests.test_spaces import assert_same_value, gymnasium_contains_may_raise, nested_spaces

SECRET = "binary-routes-test-secret-" + "x" * 20
JSON_TYPE = b"application/json"
BINARY_TYPE = BINARY_MEDIA_TYPE.encode()


class RecordingEnv(gym.Env):
    """Returns samples of its observation space and keeps what it produced and received."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, observation_space: Space[Any], action_space: Space[Any]) -> None:
        self.observation_space = copy.deepcopy(observation_space)
        self.action_space = action_space
        self.produced: list[Any] = []
        self.received: list[Any] = []

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.observation_space.seed(int(self.np_random.integers(2**31)))
        return self._produce(), {"seed": seed}

    def step(self, action: Any) -> Any:
        self.received.append(copy.deepcopy(action))
        return self._produce(), 0.5, False, False, {"n": len(self.received)}

    def _produce(self) -> Any:
        observation = self.observation_space.sample()
        self.produced.append(copy.deepcopy(observation))
        return observation


class InProcessClient(HTTPClientBase):
    """The clients' HTTP layer (bytes, cookie, error mapping) against an app in process."""

    def __init__(self, app: WorkerApp) -> None:
        super().__init__("http://in-process:1")
        self.app = app

    async def send(self, request: Request) -> Reply:
        exchange = self.exchange(request)
        headers = [(k.lower().encode(), v.encode()) for k, v in exchange.headers.items()]
        raw = await asgi_request(
            self.app, exchange.method, exchange.path, exchange.payload, headers
        )
        reply_headers = [(k.decode(), v.decode()) for k, v in raw.headers.items()]
        return exchange.replied(raw.status, reply_headers, raw.body)


class Session:
    """One session over an in-process client, in the encoding ``binary`` says."""

    def __init__(self, app: WorkerApp, description: EnvDescription, binary: bool) -> None:
        self.http = InProcessClient(app)
        self.protocol = RemoteEnvProtocol(dataclasses.replace(description, binary_values=binary))

    async def reset(self, seed: int | None = None) -> tuple[Any, dict[str, Any], Reply]:
        reply = await self.http.send(self.protocol.reset_request(seed, None))
        observation, info = self.protocol.reset_reply(reply)
        return observation, info, reply

    async def step(self, action: Any) -> tuple[Any, Reply]:
        reply = await self.http.send(self.protocol.step_recovery(action).request)
        return self.protocol.step_reply(reply), reply


async def started(factory: Any, **settings: Any) -> tuple[WorkerApp, EnvDescription]:
    app = WorkerApp(GymEnvServer(factory), Settings(workers=1, secret=SECRET, **settings))
    await app.startup()
    spaces = await asgi_request(app, "GET", "/spaces")
    return app, EnvDescription.from_json(spaces.json())


def served_env(app: WorkerApp, session: Session) -> RecordingEnv:
    env = app.server._sessions[session.protocol.session_id].env
    return env.unwrapped if hasattr(env, "unwrapped") else env


def assert_writable(value: Any) -> None:
    if isinstance(value, np.ndarray):
        assert value.flags.writeable
    elif isinstance(value, tuple | list):
        for part in value:
            assert_writable(part)
    elif isinstance(value, dict):
        for part in value.values():
            assert_writable(part)


def content_type(reply: Reply) -> str:
    return reply.headers["content-type"]


def acceptable_actions(space: Space[Any]) -> bool:
    return not gymnasium_contains_may_raise(space)


async def check_round_trips(obs_space: Space[Any], act_space: Space[Any], seed: int) -> None:
    envs: list[RecordingEnv] = []

    def factory() -> RecordingEnv:
        envs.append(RecordingEnv(obs_space, act_space))
        return envs[-1]

    app, description = await started(factory)
    try:
        assert description.binary_values
        act_space.seed(seed)
        actions = [act_space.sample() for _ in range(3)]
        actions = [a for a in actions if act_space.contains(a)]
        for binary in (True, False):
            session = Session(app, description, binary)
            observation, info, reply = await session.reset(seed)
            assert content_type(reply) == (BINARY_MEDIA_TYPE if binary else "application/json")
            env = served_env(app, session)
            assert_same_value(env.produced[-1], observation)
            assert info == {"seed": seed}
            for action in actions:
                (observation, reward, terminated, truncated, info), reply = await session.step(
                    action
                )
                assert_same_value(env.produced[-1], observation)
                assert (reward, terminated, truncated) == (0.5, False, False)
                assert info == {"n": len(env.received)}
                # The env got what the JSON codec gives of the action, bit for bit.
                assert_same_value(
                    value_from_json(act_space, value_to_json(act_space, action)),
                    env.received[-1],
                )
                if binary:
                    assert_writable(observation)
            observed = await session.http.send(_observe(binary))
            fields = reply_fields(observed)
            assert fields["episode_length"] == len(actions)
            assert_same_value(env.produced[-1], session.protocol._observation(fields))
    finally:
        await app.shutdown()


def _observe(binary: bool) -> Request:
    return Request("POST", "/observe", {}, {"Accept": BINARY_ACCEPT} if binary else {})


@pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    obs_space=nested_spaces,
    act_space=nested_spaces.filter(acceptable_actions),
    seed=st.integers(0, 2**31),
)
def test_every_space_round_trips_bit_exact_through_the_routes(
    obs_space: Space[Any], act_space: Space[Any], seed: int
) -> None:
    asyncio.run(check_round_trips(obs_space, act_space, seed))


@pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array")
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    obs_space=nested_spaces,
    act_space=nested_spaces.filter(acceptable_actions),
    seed=st.integers(0, 2**31),
)
def test_every_space_round_trips_through_step_batches(
    obs_space: Space[Any], act_space: Space[Any], seed: int
) -> None:
    asyncio.run(check_batches(obs_space, act_space, seed))


async def check_batches(obs_space: Space[Any], act_space: Space[Any], seed: int) -> None:
    app, description = await started(lambda: RecordingEnv(obs_space, act_space))
    try:
        act_space.seed(seed)
        for binary in (True, False):
            sessions = [Session(app, description, binary) for _ in range(3)]
            for session in sessions:
                await session.reset(seed)
            actions = [act_space.sample() for _ in sessions]
            assume(all(act_space.contains(a) for a in actions))
            entries = [
                {
                    "cookie": s.http.cookie,
                    "action": s.protocol.encode_action(a),
                    "episode_length": 0,
                }
                for s, a in zip(sessions, actions, strict=True)
            ]
            entries.append({**entries[0], "cookie": "not-a-cookie"})  # an entry's own error
            reply = await sessions[0].http.send(batch_request("/step_batch", entries))
            assert content_type(reply) == (BINARY_MEDIA_TYPE if binary else "application/json")
            results = batch_results(reply)
            assert results[-1]["status"] == 404
            for session, action, result in zip(sessions, actions, results, strict=False):
                env = served_env(app, session)
                observation, reward, *_ = session.protocol.step_result(result)
                assert_same_value(env.produced[-1], observation)
                assert reward == 0.5
                assert_same_value(
                    value_from_json(act_space, value_to_json(act_space, action)),
                    env.received[-1],
                )
    finally:
        await app.shutdown()


# JSON stays what it was ---------------------------------------------------------------------


def compact(content: Any) -> bytes:
    return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.fixture
async def cartpole_app() -> AsyncIterator[WorkerApp]:
    app = WorkerApp(
        GymEnvServer(lambda: gym.make("CartPole-v1")), Settings(workers=1, secret=SECRET)
    )
    await app.startup()
    yield app
    await app.shutdown()


@pytest.mark.parametrize(
    "headers",
    [
        [],  # curl -X POST
        [(b"content-type", b"application/x-www-form-urlencoded")],  # curl -d
        [(b"accept", b"*/*")],
        [(b"content-type", b"application/json"), (b"accept", b"application/json")],
        [(b"accept", b"application/vnd.gym-sessions.values; v=2")],  # a version not spoken
    ],
    ids=["bare", "curl-d", "accept-any", "json", "other-version"],
)
async def test_json_replies_are_byte_for_byte_what_they_were(cartpole_app, headers):
    local = gym.make("CartPole-v1")
    space = local.observation_space
    first, _ = local.reset(seed=7)
    reply = await asgi_request(cartpole_app, "POST", "/reset", b'{"seed": 7}', headers)
    assert reply.status == 200 and reply.headers[b"content-type"] == JSON_TYPE
    start = reply.json()
    expected = {
        "resources_session_id": start["resources_session_id"],
        "observation": value_to_json(space, first),
        "info": {},
        "mcp": start["mcp"],
    }
    assert reply.body == compact(expected)
    cookie = (b"cookie", reply.headers[b"set-cookie"].split(b";", 1)[0])
    for action in (0, 1, 1):
        observation, reward, terminated, truncated, info = local.step(action)
        body = json.dumps({"action": action}).encode()
        reply = await asgi_request(cartpole_app, "POST", "/step", body, [*headers, cookie])
        assert reply.headers[b"content-type"] == JSON_TYPE
        assert reply.body == compact(
            {
                "observation": value_to_json(space, observation),
                "reward": float(reward),
                "terminated": terminated,
                "truncated": truncated,
                "info": info,
            }
        )
    reply = await asgi_request(cartpole_app, "POST", "/observe", b"{}", [*headers, cookie])
    assert reply.body == compact(
        {"observation": value_to_json(space, observation), "episode_length": 3}
    )
    observation, reward, terminated, truncated, info = local.step(0)
    batch = json.dumps({"entries": [{"cookie": cookie[1].split(b"=", 1)[1].decode(), "action": 0}]})
    reply = await asgi_request(cartpole_app, "POST", "/step_batch", batch.encode(), headers)
    assert reply.headers[b"content-type"] == JSON_TYPE
    (result,) = reply.json()["results"]
    assert (
        reply.body
        == json.dumps(
            {
                "results": [
                    {
                        "observation": value_to_json(space, observation),
                        "reward": float(reward),
                        "terminated": terminated,
                        "truncated": truncated,
                        "info": info,
                        "worker": result["worker"],
                    }
                ]
            }
        ).encode()
    )


async def test_mcp_gets_json_whatever_the_accept_header(cartpole_app):
    reply = await asgi_request(cartpole_app, "POST", "/reset", b'{"seed": 1}')
    token = reply.json()["mcp"]["headers"]["X-Gym-Session-Token"]
    call = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "step", "arguments": {"action": 1}},
    }
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", BINARY_ACCEPT.encode()),
        (b"x-gym-session-token", token.encode()),
    ]
    reply = await asgi_request(cartpole_app, "POST", "/mcp", json.dumps(call).encode(), headers)
    assert reply.headers[b"content-type"] == JSON_TYPE
    structured = reply.json()["result"]["structuredContent"]
    assert len(structured["observation"]) == 4 and isinstance(structured["observation"][0], float)


async def test_a_client_of_a_server_without_the_offer_speaks_json(cartpole_app):
    spaces = (await asgi_request(cartpole_app, "GET", "/spaces")).json()
    del spaces["binary_values"]  # what an older server answers
    session = Session(cartpole_app, EnvDescription.from_json(spaces), binary=False)
    assert not session.protocol.description.binary_values
    request = session.protocol.reset_request(0, None)
    assert "Accept" not in request.headers
    _, _, reply = await session.reset(0)
    assert content_type(reply) == "application/json"
    step = session.protocol.step_recovery(1).request
    assert step.body == {"action": 1} and "Accept" not in step.headers
    (observation, *_), reply = await session.step(1)
    assert content_type(reply) == "application/json" and observation.shape == (4,)


# Repeated seeds and snapshots -----------------------------------------------------------------


async def test_a_repeated_seed_gets_its_reply_in_the_encoding_it_asks_for(cartpole_app):
    spaces = (await asgi_request(cartpole_app, "GET", "/spaces")).json()
    description = EnvDescription.from_json(spaces)
    session = Session(cartpole_app, description, binary=False)
    names = {"resources_session_id": session.protocol.session_id, "session_key": "k" * 20}
    body = json.dumps({**names, "seed": 3}).encode()
    as_json = await asgi_request(cartpole_app, "POST", "/seed_session", body)
    again = await asgi_request(
        cartpole_app, "POST", "/seed_session", body, [(b"accept", BINARY_ACCEPT.encode())]
    )
    assert again.headers[b"content-type"] == BINARY_TYPE
    fields = reply_fields(Reply(200, {"content-type": BINARY_MEDIA_TYPE}, again.body))
    observation = session.protocol._observation(fields)
    assert_same_value(
        value_from_json(description.observation_space, as_json.json()["observation"]),
        observation,
    )
    assert fields["mcp"] == as_json.json()["mcp"]


def test_a_space_value_pickles_as_its_description_and_value():
    space = Box(0, 255, (210, 160, 3), np.uint8)
    value = SpaceValue(space, space.sample())
    data = pickle.dumps(value)
    assert len(data) < 102_000  # the frame (100,800 B) and a description, no bounds arrays
    restored = pickle.loads(data)
    assert restored.to_json() == value.to_json()
    assert restored.to_binary().tree == value.to_binary().tree


# Bad binary bodies ----------------------------------------------------------------------------

BOX_ACTIONS = Box(-1.0, 1.0, (3,), np.float32)
ACTION = np.array([0.25, -0.5, 1.0], np.float32)


def step_message(tree: Any, *blobs: bytes, head: dict[str, Any] | None = None) -> bytes:
    content = (
        head if head is not None else {"action": {"tree": tree, "buffers": list(range(len(blobs)))}}
    )
    return frame(json.dumps(content).encode(), list(blobs))


GOOD_REF = {"buffer": 0, "dtype": "<f4", "shape": [3]}
GOOD = ACTION.tobytes()
GOOD_MESSAGE = step_message(GOOD_REF, GOOD)

BAD_STEPS: dict[str, tuple[bytes, bytes, int, str]] = {
    "empty": (b"", BINARY_TYPE, 400, "invalid_binary"),
    "truncated": (GOOD_MESSAGE[:-5], BINARY_TYPE, 400, "invalid_binary"),
    "trailing": (GOOD_MESSAGE + b"\0" * 8, BINARY_TYPE, 400, "invalid_binary"),
    "blob-table-past-end": (
        struct.pack("<IIQ", 2, 1, 2**40) + b"{}",
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "head-not-utf8": (frame(b'{"action": "\xff"}', []), BINARY_TYPE, 400, "invalid_binary"),
    "head-nan": (frame(b'{"action": NaN}', []), BINARY_TYPE, 400, "invalid_binary"),
    "head-too-deep": (
        frame(b"[" * 30_000 + b"]" * 30_000, []),
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "head-not-object": (frame(b"[1]", []), BINARY_TYPE, 400, "invalid_binary"),
    "action-not-value-object": (
        step_message(None, head={"action": [0.25, -0.5, 1.0]}),
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "blob-named-twice": (
        frame(json.dumps({"action": {"tree": GOOD_REF, "buffers": [0, 0]}}).encode(), [GOOD]),
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "blob-of-no-value": (
        frame(json.dumps({"action": {"tree": GOOD_REF, "buffers": [0]}}).encode(), [GOOD, GOOD]),
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "blob-out-of-range": (
        frame(json.dumps({"action": {"tree": GOOD_REF, "buffers": [3]}}).encode(), [GOOD]),
        BINARY_TYPE,
        400,
        "invalid_binary",
    ),
    "no-action": (frame(b"{}", []), BINARY_TYPE, 400, "invalid_request"),
    "wrong-dtype": (
        step_message({**GOOD_REF, "dtype": "<f8"}, np.zeros(3).tobytes()),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "object-dtype": (
        step_message({**GOOD_REF, "dtype": "|O"}, GOOD),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "big-endian": (
        step_message({**GOOD_REF, "dtype": ">f4"}, GOOD),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "wrong-shape": (
        step_message({**GOOD_REF, "shape": [1, 3]}, GOOD),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "short-buffer": (step_message(GOOD_REF, GOOD[:8]), BINARY_TYPE, 400, "invalid_request"),
    "long-buffer": (step_message(GOOD_REF, GOOD + GOOD), BINARY_TYPE, 400, "invalid_request"),
    "huge-shape-claim": (
        step_message({**GOOD_REF, "shape": [10**15]}, GOOD),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "buffer-not-in-value": (
        step_message({**GOOD_REF, "buffer": 1}, GOOD, GOOD),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "outside-the-space": (
        step_message(GOOD_REF, np.array([5, 0, 0], np.float32).tobytes()),
        BINARY_TYPE,
        400,
        "invalid_request",
    ),
    "other-version": (
        GOOD_MESSAGE,
        b"application/vnd.gym-sessions.values; v=2",
        415,
        "unsupported_media_type",
    ),
    "no-version": (
        GOOD_MESSAGE,
        b"application/vnd.gym-sessions.values",
        415,
        "unsupported_media_type",
    ),
    "oversized": (
        step_message(GOOD_REF, GOOD) + b"\0" * 70_000,
        BINARY_TYPE,
        413,
        "body_too_large",
    ),
}


@pytest.fixture
async def box_app() -> AsyncIterator[WorkerApp]:
    app = WorkerApp(
        GymEnvServer(lambda: RecordingEnv(Box(-1, 1, (2,), np.float32), BOX_ACTIONS)),
        Settings(workers=1, secret=SECRET, max_body_bytes=65536),
    )
    await app.startup()
    yield app
    await app.shutdown()


async def start_box_session(app: WorkerApp) -> tuple[bytes, bytes]:
    reply = await asgi_request(app, "POST", "/reset", b"{}", [(b"accept", BINARY_ACCEPT.encode())])
    assert reply.status == 200
    cookie = reply.headers[b"set-cookie"].split(b";", 1)[0]
    return cookie, reply.body


async def episode_length(app: WorkerApp, cookie: bytes) -> int:
    reply = await asgi_request(app, "POST", "/observe", b"{}", [(b"cookie", cookie)])
    return reply.json()["episode_length"]


@pytest.mark.parametrize("name", sorted(BAD_STEPS))
async def test_bad_binary_steps_get_a_json_error_and_change_nothing(box_app, name):
    body, kind, status, code = BAD_STEPS[name]
    cookie, _ = await start_box_session(box_app)
    headers = [(b"cookie", cookie), (b"content-type", kind), (b"accept", BINARY_ACCEPT.encode())]
    reply = await asgi_request(box_app, "POST", "/step", body, headers)
    assert (reply.status, reply.headers[b"content-type"]) == (status, JSON_TYPE), reply.body
    assert reply.json()["error"]["code"] == code
    assert await episode_length(box_app, cookie) == 0
    # The same session still steps with a good body.
    headers[1] = (b"content-type", BINARY_TYPE)
    reply = await asgi_request(box_app, "POST", "/step", GOOD_MESSAGE, headers)
    assert reply.status == 200 and reply.headers[b"content-type"] == BINARY_TYPE
    env = box_app.server._sessions
    (served,) = [state.env for state in env.values() if state.episode_length == 1]
    assert_same_value(ACTION, served.received[-1])
    assert served.received[-1].flags.writeable  # the env may write into its action


async def test_media_types_are_case_insensitive(box_app):
    cookie, _ = await start_box_session(box_app)
    headers = [
        (b"cookie", cookie),
        (b"content-type", b"Application/Vnd.Gym-Sessions.Values ;V=1"),
        (b"accept", b"APPLICATION/VND.GYM-SESSIONS.VALUES; v=1"),
    ]
    reply = await asgi_request(box_app, "POST", "/step", GOOD_MESSAGE, headers)
    assert reply.status == 200 and reply.headers[b"content-type"] == BINARY_TYPE


@pytest.mark.parametrize(
    "path", ["/reset", "/seed_session", "/verify", "/close_session", "/render"]
)
async def test_routes_without_values_refuse_binary_bodies(box_app, path):
    cookie, _ = await start_box_session(box_app)
    headers = [(b"cookie", cookie), (b"content-type", BINARY_TYPE)]
    reply = await asgi_request(box_app, "POST", path, frame(b"{}", []), headers)
    assert reply.status == 415 and reply.headers[b"content-type"] == JSON_TYPE
    assert reply.json()["error"]["code"] == "unsupported_media_type"


BAD_BATCHES: dict[str, tuple[Any, list[bytes], str]] = {
    "action-inline": ({"entries": [{"cookie": "c", "action": [0, 0, 0]}]}, [], "invalid_binary"),
    "blob-shared": (
        {
            "entries": [
                {"cookie": "c", "action": {"tree": GOOD_REF, "buffers": [0]}},
                {"cookie": "d", "action": {"tree": GOOD_REF, "buffers": [0]}},
            ]
        },
        [GOOD],
        "invalid_binary",
    ),
    "not-entries": ({"entries": {"action": 1}}, [], "invalid_request"),
    "no-cookie": (
        {"entries": [{"action": {"tree": GOOD_REF, "buffers": [0]}}]},
        [GOOD],
        "invalid_request",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD_BATCHES))
async def test_bad_binary_batches_get_a_json_error(box_app, name):
    head, blobs, code = BAD_BATCHES[name]
    headers = [(b"content-type", BINARY_TYPE), (b"accept", BINARY_ACCEPT.encode())]
    body = frame(json.dumps(head).encode(), blobs)
    reply = await asgi_request(box_app, "POST", "/step_batch", body, headers)
    assert reply.status == 400 and reply.headers[b"content-type"] == JSON_TYPE
    assert reply.json()["error"]["code"] == code


async def test_a_bad_entry_value_is_that_entrys_error_only(box_app):
    good, _ = await start_box_session(box_app)
    bad, _ = await start_box_session(box_app)
    wrong = np.zeros(3).tobytes()  # float64 bytes under a float32 reference
    head = {
        "entries": [
            {
                "cookie": good.split(b"=", 1)[1].decode(),
                "action": {"tree": GOOD_REF, "buffers": [0]},
            },
            {
                "cookie": bad.split(b"=", 1)[1].decode(),
                "action": {"tree": {**GOOD_REF, "dtype": "<f8"}, "buffers": [1]},
            },
        ]
    }
    headers = [(b"content-type", BINARY_TYPE), (b"accept", BINARY_ACCEPT.encode())]
    body = frame(json.dumps(head).encode(), [GOOD, wrong])
    reply = await asgi_request(box_app, "POST", "/step_batch", body, headers)
    assert reply.status == 200 and reply.headers[b"content-type"] == BINARY_TYPE
    first, second = batch_results(Reply(200, {"content-type": BINARY_MEDIA_TYPE}, reply.body))
    assert isinstance(first["observation"], BinaryValue)
    assert second["status"] == 400 and second["error"]["code"] == "invalid_request"
    assert await episode_length(box_app, good) == 1
    assert await episode_length(box_app, bad) == 0


async def test_binary_step_of_a_discrete_env_sends_the_tree_alone():
    app = WorkerApp(GymEnvServer(CounterEnv), Settings(workers=1, secret=SECRET))
    await app.startup()
    try:
        spaces = (await asgi_request(app, "GET", "/spaces")).json()
        session = Session(app, EnvDescription.from_json(spaces), binary=True)
        await session.reset(0)
        request = session.protocol.step_recovery(3).request
        assert isinstance(request.body, EncodedBody)
        assert request.headers["Accept"] == BINARY_ACCEPT
        space = Discrete(21, start=-10)
        assert request.body.data == encode_message(
            {"action": BinaryValue(*value_to_tree(space, 3))}, STEP_BODY
        )
        (observation, reward, *_), reply = await session.step(3)
        assert content_type(reply) == BINARY_MEDIA_TYPE and reward == 0.0
        assert observation == np.array(3, np.int64) and observation.flags.writeable
    finally:
        await app.shutdown()
