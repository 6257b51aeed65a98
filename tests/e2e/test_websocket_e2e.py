"""``/ws`` on real uvicorn workers: routing, resumption, bad frames, ownership (§3.16)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import urllib.request
import uuid
from typing import Any

import numpy as np
import pytest
from gymnasium.vector import AutoresetMode
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gym_sessions import AsyncRemoteEnv, RemoteVectorEnv
from gym_sessions.client.step_recovery import OBSERVE_REQUEST
from gym_sessions.errors import ConnectionLostError
from gym_sessions.metrics.status import parse_samples
from tests.conftest import require_or_skip
from tests.e2e.pixel_envs import FRAME_SHAPE, PixelEnv
from tests.polling import eventually
from tests.services import NginxProcess

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
PIXELS = "tests.e2e.pixel_envs:PixelEnv"
WORKERS = 4


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return str(reply.read().decode())


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


class Wire:
    """A bare ``/ws`` connection speaking request envelopes (no client library of ours)."""

    def __init__(self, connection: ClientConnection) -> None:
        self.connection = connection
        self.next_id = 0

    @classmethod
    async def open(cls, url: str, cookie: str | None = None) -> Wire:
        headers = {"Cookie": f"gym_session={cookie}"} if cookie else {}
        return cls(await connect(ws_url(url), additional_headers=headers))

    async def request(self, path: str, body: Any = None, **fields: Any) -> dict[str, Any]:
        self.next_id += 1
        message = {"id": self.next_id, "path": path, "body": body, **fields}
        await self.connection.send(json.dumps(message))
        reply = json.loads(await self.connection.recv())
        assert reply["id"] == self.next_id
        return reply

    async def close(self) -> None:
        await self.connection.close()


def header(reply: dict[str, Any], name: str) -> str | None:
    for key, value in reply["headers"]:
        if key == name:
            return str(value)
    return None


def cookie_of(reply: dict[str, Any]) -> str:
    value = header(reply, "set-cookie")
    assert value is not None, reply
    return value.split(";", 1)[0].split("=", 1)[1]


async def test_sessions_on_a_new_websocket_per_step_reach_their_holders(serve):
    server = serve(COUNTER, "--debug-worker-header", workers=WORKERS)
    sessions, steps, most_starts = 24, 6, 120

    async def start(index: int) -> tuple[str, str]:
        wire = await Wire.open(server.url)
        reply = await wire.request(
            "/reset", {"options": {"initial_count": index * 100}}, new_session=True
        )
        await wire.close()
        assert reply["status"] == 200, reply
        holder = header(reply, "x-gym-worker")
        assert holder is not None
        return cookie_of(reply), holder

    # A /ws start is held where its connection was accepted (no placement), and
    # asyncio accepts a whole burst in one worker's wake-up: so the starts go
    # one at a time, until the sessions sit on more than one worker (otherwise
    # the steps below could all meet their holder without any routing).
    started: list[tuple[str, str]] = []
    while len(started) < sessions or len({h for _, h in started}) < 2:
        assert len(started) < most_starts, "every /ws start landed on one worker"
        started.append(await start(len(started)))

    async def play(index: int, cookie: str) -> set[str]:
        served_by: set[str] = set()
        total = index * 100
        for step in range(steps):
            action = (index + step) % 21 - 10
            total += action
            # A new connection per step, all sessions at once: any worker accepts it.
            wire = await Wire.open(server.url, cookie)
            reply = await wire.request(
                "/step", {"action": action}, headers={"x-gym-episode-length": str(step)}
            )
            await wire.close()
            assert reply["status"] == 200, reply
            assert reply["body"]["observation"] == total
            served_by.add(str(header(reply, "x-gym-worker")))
        return served_by

    served = await asyncio.gather(*(play(i, cookie) for i, (cookie, _) in enumerate(started)))
    for served_by, (_, holder) in zip(served, started, strict=True):
        assert served_by == {holder}  # every step was served by the session's holder
    health = server.health()
    assert health["status"] == "ok"


async def test_remote_envs_over_websockets_count_exactly_at_four_workers(shared_serve):
    server = shared_serve(COUNTER, workers=WORKERS)
    sessions, steps = 32, 6

    async def play(index: int) -> None:
        async with AsyncRemoteEnv(server.url, transport="ws") as env:
            observation, _ = await env.reset(options={"initial_count": index, "expected_count": 0})
            count = int(observation)
            for step in range(steps):
                action = (step * 7 + index) % 21 - 10
                observation, *_ = await env.step(action)
                count += action
                assert int(observation) == count
            result = await env.verify(close_follows=True)
            assert result["episode_length"] == steps

    await asyncio.gather(*(play(i) for i in range(sessions)))


class CuttingProxy:
    """A TCP relay that cuts each connection once, at its ``cut_at``-th chunk of one direction.

    Odd connections lose the holder's reply to a step (the step ran); even ones
    lose the client's step before it reaches the server (it did not run).
    """

    def __init__(self, target_port: int, cut_at: int = 4) -> None:
        self.target_port = target_port
        self.cut_at = cut_at
        self.connections = 0
        self.cuts = 0
        #: Cut connections made while armed only.
        self.armed = True
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        cut_replies = self.connections % 2 == 1
        armed = self.armed
        try:
            await self._pump_both(reader, writer, cut_replies, armed)
        except (asyncio.CancelledError, OSError):
            writer.transport.abort()

    async def _pump_both(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        cut_replies: bool,
        armed: bool,
    ) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        cut = asyncio.Event()

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, cuts: bool) -> None:
            chunks = 0
            while not cut.is_set():
                data = await src.read(65536)
                if not data:
                    break
                chunks += 1
                if armed and cuts and chunks == self.cut_at:
                    self.cuts += 1
                    cut.set()
                    break
                dst.write(data)
                await dst.drain()
            cut.set()

        tasks = [
            asyncio.create_task(pump(reader, up_writer, not cut_replies)),
            asyncio.create_task(pump(up_reader, writer, cut_replies)),
        ]
        await cut.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in (writer, up_writer):
            stream.transport.abort()

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()


async def test_a_killed_websocket_resumes_its_session_and_counts_stay_exact(shared_serve):
    server = shared_serve(COUNTER, workers=WORKERS)
    port = int(server.url.rsplit(":", 1)[1])
    proxy = CuttingProxy(port)
    proxy_port = await proxy.start()
    url = f"http://127.0.0.1:{proxy_port}"
    sessions, steps = 8, 12
    ran_lost = 0
    finished: set[int] = set()
    lost_messages: list[str] = []
    unarmed = asyncio.Event()

    async def play(index: int) -> None:
        nonlocal ran_lost
        env = AsyncRemoteEnv(url, transport="ws", retries=2)
        await env.open()
        observation, _ = await env.reset(options={"initial_count": 1000 * index})
        session_id = env.session_id
        count = 1000 * index
        taken = 0
        for step in range(steps):
            action = (step + index) % 9 + 1
            try:
                observation, *_ = await env.step(action)
            except ConnectionLostError as error:
                # The step ran on the server; only its reply was lost.
                lost_messages.append(str(error))
                ran_lost += 1
                count += action
                taken += 1
                continue
            count += action
            taken += 1
            assert int(observation) == count
        assert env.session_id == session_id  # never a new session
        assert env._http.cookie is not None
        finished.add(index)
        if len(finished) == sessions:
            proxy.armed = False  # (the last checks' replies are not cut)
            unarmed.set()
        await unarmed.wait()
        await env._http.close()  # a connection opened unarmed
        result = await env.verify(close_follows=True)
        assert result["episode_length"] == taken == steps
        observed = (await env._http.send(OBSERVE_REQUEST)).json()
        assert observed["observation"] == count  # each step ran exactly once
        await env.close()

    try:
        await asyncio.gather(*(play(i) for i in range(sessions)))
    finally:
        await proxy.stop()
    assert proxy.cuts >= sessions  # every session's WebSocket was cut at least once
    assert ran_lost > 0  # and some steps ran with their reply lost
    assert all("ran on the server" in message for message in lost_messages)
    assert proxy.cuts - ran_lost > 0  # and others never reached the server (resent)
    print(f"cuts {proxy.cuts}, ran with reply lost {ran_lost}")


async def test_a_websocket_whose_holder_died_closes_with_4410(serve):
    server = serve(COUNTER, "--debug-worker-header", workers=2)
    for _ in range(20):
        wire = await Wire.open(server.url)
        start = await wire.request("/reset", {}, new_session=True)
        holder = str(header(start, "x-gym-worker"))
        cookie = cookie_of(start)
        await wire.close()
        probe = await Wire.open(server.url, cookie)
        health = await probe.request("/health", method="GET")
        await probe.close()
        if header(health, "x-gym-worker") != holder:
            break  # the probe's connection landed on the other worker
    os.kill(int(holder.split("-")[0]), signal.SIGKILL)
    for _ in range(40):  # until a connection lands on the survivor
        try:
            wire = await Wire.open(server.url, cookie)
            reply = await wire.request("/step", {"action": 1})
        except (ConnectionClosed, OSError):
            await asyncio.sleep(0.1)
            continue
        if reply["status"] == 410:
            assert reply["body"]["error"]["code"] == "session_gone"
            with pytest.raises(ConnectionClosed):
                await wire.connection.recv()
            assert wire.connection.close_code == 4410
            assert "session_gone" in (wire.connection.close_reason or "")
            return
        await wire.close()
    pytest.fail("no connection reached a surviving worker")


async def _closed_with(wire: Wire) -> tuple[int | None, str | None]:
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(wire.connection.recv(), 10)
    return wire.connection.close_code, wire.connection.close_reason


def _raw_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


async def test_bad_frames_close_with_a_code_and_reason_and_touch_no_session(serve):
    server = serve(COUNTER, "--max-body-bytes", "1024", workers=2)
    owner = await Wire.open(server.url)
    start = await owner.request("/reset", {"options": {"initial_count": 7}}, new_session=True)
    assert start["status"] == 200
    cookie = cookie_of(start)

    cases: list[tuple[Any, int, str]] = [
        (b"\x00\x01binary", 1003, "binary"),
        ("{not json", 1007, "JSON"),
        ('{"id": 1, "path": "/step", "body": NaN}', 1007, "JSON"),
        ("[1, 2]", 1007, "object"),
        ('{"id": "x", "path": "/step"}', 1007, "id"),
        ('{"id": 1, "path": "/step", "headers": {"cookie": "gym_session=x"}}', 1007, "cookie"),
        ('{"id": 1, "path": "http://elsewhere/step"}', 1007, "path"),
        ('{"id": 1, "path": "/rollouts/r1/step_batch", "body": {}}', 1007, "use HTTP"),
        ('{"id": 1, "path": "/metrics", "method": "GET"}', 1007, "use HTTP"),
        ("x" * (1024 + 64 * 1024 + 1), 1009, "exceeds"),
    ]
    for frame, code, words in cases:
        wire = await Wire.open(server.url, cookie)
        await wire.connection.send(frame)
        close_code, reason = await _closed_with(wire)
        assert close_code == code, (frame[:40], close_code, reason)
        assert words.lower() in (reason or "").lower(), reason

    # A reserved opcode (0x3): the WebSocket library closes with 1002.
    port = int(server.url.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    writer.write(_raw_frame(0x3, b"hello"))
    frame = await asyncio.wait_for(reader.read(2), 10)
    assert frame[0] & 0x0F == 0x8  # a close frame
    rest = await asyncio.wait_for(reader.read(256), 10)
    assert int.from_bytes(rest[:2], "big") == 1002
    writer.close()

    # The session is as its owner left it.
    observed = await owner.request("/observe", {})
    assert observed["body"] == {"observation": 7, "episode_length": 0}
    await owner.close()
    assert server.health()["status"] == "ok"


async def test_another_sessions_credentials_are_refused(shared_serve):
    server = shared_serve(COUNTER, workers=WORKERS)
    owner = await Wire.open(server.url)
    victim = f"victim-{uuid.uuid4().hex}"
    key = "k" * 32
    start = await owner.request(
        "/seed_session",
        {"resources_session_id": victim, "session_key": key, "options": {"initial_count": 3}},
        new_session=True,
    )
    assert start["status"] == 200, start
    owner_cookie = cookie_of(start)

    intruder = await Wire.open(server.url)
    # A bare session id is no credential: a start of it without its key is refused.
    reset = await intruder.request("/reset", {"resources_session_id": victim})
    assert reset["status"] == 409 and reset["body"]["error"]["code"] == "session_conflict"
    wrong = await intruder.request(
        "/close_session", {"resources_session_id": victim, "session_key": "z" * 32}
    )
    assert wrong["status"] == 409
    # Without the cookie a step names no session of anybody's.
    step = await intruder.request("/step", {"action": 5})
    assert step["status"] == 404
    # A message cannot bring a cookie of its own (closed 1007, checked above).
    await intruder.close()

    # Another session's cookie reaches that session only; a tampered one nothing.
    forged = await Wire.open(server.url, owner_cookie[:-2] + "xx")
    step = await forged.request("/step", {"action": 5})
    assert step["status"] == 404
    await forged.close()

    observed = await owner.request("/observe", {})
    assert observed["body"] == {"observation": 3, "episode_length": 0}
    reply = await owner.request("/step", {"action": 2})
    assert reply["body"]["observation"] == 5
    await owner.close()


def test_ws_endpoint_refuses_other_websocket_paths(shared_serve):
    server = shared_serve(COUNTER)
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"GET /other HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 403")


async def test_pixel_observations_travel_as_binary_frames_bit_exact(serve):
    server = serve(PIXELS, workers=2)
    local = PixelEnv()
    async with AsyncRemoteEnv(server.url, transport="ws") as env:
        assert env.description.binary_values
        observation, _ = await env.reset(seed=3)
        connection = env._http._connection
        assert connection is not None and connection.subprotocol == "gym-sessions.values.v1"
        frames: list[type] = []
        recv = connection.recv

        async def counting_recv(*args: Any, **kwargs: Any) -> Any:
            message = await recv(*args, **kwargs)
            frames.append(type(message))
            return message

        connection.recv = counting_recv  # type: ignore[method-assign]
        expected, _ = local.reset(seed=3)
        np.testing.assert_array_equal(observation, expected)
        for step in range(20):
            got, want = await env.step(step % 6), local.step(step % 6)
            assert got[0].shape == FRAME_SHAPE and got[0].dtype == np.uint8
            np.testing.assert_array_equal(got[0], want[0])
            assert got[1:4] == want[1:4]
        assert frames == [bytes] * 20  # each step's reply was a binary frame


async def test_a_binary_frame_without_the_values_subprotocol_names_it(shared_serve):
    server = shared_serve(COUNTER)
    wire = await Wire.open(server.url)
    await wire.connection.send(b"\0\0\0\2{}")
    code, reason = await _closed_with(wire)
    assert code == 1003 and "gym-sessions.values.v1" in (reason or "")


async def test_bad_binary_frames_on_a_values_connection(shared_serve):
    server = shared_serve(COUNTER)
    for frame, code in [
        (b"\0\0\1\0{}", 1007),  # the envelope's length runs past the frame
        (b"\0\0\0\2\xff\xfe", 1007),  # not UTF-8
        (b'\0\0\0\x0f{"id": 1, "pa":', 1007),  # not JSON
    ]:
        connection = await connect(ws_url(server.url), subprotocols=["gym-sessions.values.v1"])
        wire = Wire(connection)
        await connection.send(frame)
        closed, reason = await _closed_with(wire)
        assert closed == code, (frame, closed, reason)
    # A well-formed envelope with a body that is no binary message: the route's 400.
    connection = await connect(ws_url(server.url), subprotocols=["gym-sessions.values.v1"])
    wire = Wire(connection)
    start = await wire.request("/reset", {}, new_session=True)
    assert start["status"] == 200
    envelope = json.dumps({"id": 9, "path": "/step", "headers": {"x-gym-episode-length": "0"}})
    await connection.send(len(envelope).to_bytes(4, "big") + envelope.encode() + b"garbage")
    reply = json.loads(await connection.recv())
    assert reply["id"] == 9 and reply["status"] == 400, reply
    assert reply["body"]["error"]["code"] == "invalid_binary"
    observed = await wire.request("/observe", {})
    assert observed["body"]["episode_length"] == 0
    await wire.close()


async def test_200_sessions_over_websockets_through_nginx_count_exactly(shared_serve):
    require_or_skip("nginx", "nginx")
    server = shared_serve(COUNTER, workers=WORKERS)
    nginx = NginxProcess([server.url]).start()
    sessions, steps = 200, 6
    holders: dict[int, str] = {}

    async def play(index: int) -> int:
        env = AsyncRemoteEnv(nginx.url, transport="ws", timeout=120)
        await env.open()
        try:
            observation, _ = await env.reset(options={"initial_count": index})
            count = index
            for step in range(steps):
                if index % 2 and step == steps // 2:
                    await env._http.close()  # a new WebSocket mid-episode: lands anywhere
                action = (index * 3 + step) % 21 - 10
                observation, *_ = await env.step(action)
                count += action
                assert int(observation) == count, (index, step)
            health = await env._http.send(env.protocol.health_request())
            holders[index] = str(health.json()["worker"])  # through the routing: the holder
            result = await env.verify(close_follows=True)
            assert result["episode_length"] == steps
            return count
        finally:
            await env.close()

    try:
        counts = await asyncio.gather(*(play(i) for i in range(sessions)))
    finally:
        nginx.close()
    assert counts == [i + sum((i * 3 + s) % 21 - 10 for s in range(steps)) for i in range(sessions)]
    assert len(set(holders.values())) == WORKERS  # every worker held some of them


async def test_durable_sessions_over_websockets_survive_their_holders_death(serve):
    server = serve(COUNTER, "--durable-sessions", workers=2)
    sessions, steps, kill_after = 8, 10, 4
    halfway = asyncio.Barrier(sessions + 1)
    holders: list[str] = []
    resumed = asyncio.Event()
    envs = [AsyncRemoteEnv(server.url, transport="ws") for _ in range(sessions)]

    async def play(index: int, env: AsyncRemoteEnv) -> tuple[int, int]:
        await env.open()
        observation, _ = await env.reset(options={"initial_count": 10 * index})
        count, taken = 10 * index, 0
        for step in range(steps):
            if step == kill_after:
                await halfway.wait()
                await resumed.wait()
            action = step % 5 + 1
            try:
                observation, *_ = await env.step(action)
            except ConnectionLostError:
                pass  # it ran; its reply was lost
            else:
                assert int(observation) == count + action
            count, taken = count + action, taken + 1
        observed = (await env._http.send(OBSERVE_REQUEST)).json()
        await env.close()
        return observed["observation"], observed["episode_length"]

    async def holder(env: AsyncRemoteEnv) -> str:
        return str((await env._http.send(env.protocol.health_request())).json()["worker"])

    async def kill_a_holder() -> None:
        await halfway.wait()
        holders.extend([await holder(env) for env in envs])
        victim = holders[0]
        os.kill(int(victim.split("-")[0]), signal.SIGKILL)
        resumed.set()

    results, _ = await asyncio.gather(
        asyncio.gather(*(play(i, env) for i, env in enumerate(envs))), kill_a_holder()
    )
    for index, (count, length) in enumerate(results):
        assert length == steps
        assert count == 10 * index + sum(step % 5 + 1 for step in range(steps))
    victims = holders.count(holders[0])
    page = parse_samples(await asyncio.to_thread(fetch, server.url + "/metrics"))
    restored = sum(s.value for s in page if s.name == "gym_sessions_restored_sessions_total")
    assert 1 <= restored <= victims  # the dead holder's sessions went on elsewhere


def test_a_vector_env_over_websockets_steps_each_session_on_its_holder(shared_serve):
    server = shared_serve(COUNTER, workers=WORKERS)
    envs = RemoteVectorEnv(8, server.url, transport="ws", autoreset_mode=AutoresetMode.DISABLED)
    try:
        assert envs.step_batch is None  # one step message per sub-env
        observations, _ = envs.reset(seed=0)
        counts = np.zeros(8, np.int64)
        np.testing.assert_array_equal(observations, counts)
        for step in range(10):
            actions = np.array([(i * 3 + step) % 21 - 10 for i in range(8)])
            observations, *_ = envs.step(actions)
            counts += actions
            np.testing.assert_array_equal(observations, counts)
        assert all(env.transport == "ws" for env in envs.envs)
    finally:
        envs.close()


@pytest.mark.parametrize("workers", [1, 4])
async def test_a_websocket_that_drops_cancels_its_awaiting_tool_as_http_does(serve, workers):
    server = serve("tests.e2e.slow_tools:SlowToolServer", "--debug-worker-header", workers=workers)
    wire = await Wire.open(server.url)
    start = await wire.request("/reset", {"resources_session_id": "slow-ws-1"}, new_session=True)
    assert start["status"] == 200, start
    cookie = cookie_of(start)
    for _ in range(50 if workers > 1 else 0):
        # A connection on another worker than the holder: the hop passes the drop on.
        await wire.close()
        wire = await Wire.open(server.url, cookie)
        if header(await wire.request("/tally", {}), "x-gym-forwarded-by") is not None:
            break
    else:
        assert workers == 1, "no connection landed on a worker other than the holder"
    await wire.connection.send(json.dumps({"id": 99, "path": "/wait", "body": {"seconds": 60}}))
    await asyncio.sleep(1.0)
    wire.connection.transport.abort()  # the client is gone mid-call

    async def tally() -> dict[str, Any] | None:
        again = await Wire.open(server.url, cookie)
        reply = await again.request("/tally", {})
        await again.close()
        assert reply["status"] == 200, reply
        return reply["body"] if reply["body"]["cancelled"] else None

    expected = {"started": 1, "finished": 0, "cancelled": 1, "starts": 1}
    assert await eventually(tally, 5) == expected
    resumed = await Wire.open(server.url, cookie)
    reply = await resumed.request("/wait", {"seconds": 0.05})
    assert reply["body"] == {**expected, "started": 2, "finished": 1}
    await resumed.close()
