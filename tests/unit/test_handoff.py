"""Connection handoff with in-process workers: real Unix sockets, real uvicorn protocols.

Each client here is a raw kept-alive HTTP/1.1 connection to one worker's public
listener, so a test knows which worker accepted it and sees every byte.
"""

from __future__ import annotations

import array
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from envs.counter import CounterEnv
from gym_sessions.routing.handoff import (
    ACK_REFUSED,
    ACK_TAKEN,
    HandoffLost,
    HandoffUndecided,
    _Channel,
    pack_message,
    replay_bytes,
)
from gym_sessions.routing.handoff_listener import HandoffListener
from gym_sessions.server.env_server import GymEnvServer
from tests.conftest import needs_handoff

from .cluster import Cluster, new_id, wait_until
from .probe_server import ProbeServer

# Each cluster test here turns handoff on itself: its copy with handoff off is not run.
pytestmark = pytest.mark.handoff_only
#: The tests that hand connections over; the listener's own tests run on any uvicorn.
NEEDS_HANDOFF = needs_handoff()
#: `Handoff.again_from_request`: a connection handed in moves on from its 16th request there.
AGAIN_FROM_REQUEST = 16


class RawConnection:
    """One kept-alive HTTP/1.1 connection; replies parsed by hand (content-length only)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def to(cls, path: str) -> RawConnection:
        return cls(*await asyncio.open_unix_connection(path))

    @staticmethod
    def request(method: str, path: str, cookie: str | None = None, body: bytes = b"") -> bytes:
        head = [f"{method} {path} HTTP/1.1", "Host: worker", f"Content-Length: {len(body)}"]
        if cookie is not None:
            head.append(f"Cookie: gym_session={cookie}")
        return ("\r\n".join(head) + "\r\n\r\n").encode() + body

    async def send(self, *requests: bytes) -> None:
        self.writer.write(b"".join(requests))  # several: pipelined in one write
        await self.writer.drain()

    async def reply(self) -> tuple[int, dict[str, str], Any]:
        status_line = await self.reader.readuntil(b"\r\n")
        headers: dict[str, str] = {}
        while (line := await self.reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, json.loads(body) if body else None

    async def call(self, method: str, path: str, cookie: str | None = None) -> Any:
        await self.send(self.request(method, path, cookie))
        return await self.reply()

    async def call_with_body(self, method: str, path: str, body: bytes) -> Any:
        await self.send(self.request(method, path, body=body))
        return await self.reply()

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@pytest.fixture
def handoff_cluster(start_clusters):
    async def make(n: int = 2, **kw: Any) -> Cluster:
        kw.setdefault("debug_worker_header", True)
        kw["handoff"] = True
        return await start_clusters(ProbeServer, n, **kw)

    return make


async def _seed(c: Cluster, index: int) -> str:
    start = await c[index].request("POST", "/seed_session", {"resources_session_id": new_id()})
    assert start.status == 200 and start.json["worker"] == c[index].id
    assert start.cookie is not None
    return start.cookie


async def _deliveries(c: Cluster, index: int) -> dict[str, Any]:
    health = await c[index].request("GET", "/health")
    assert health.json["worker"] == c[index].id
    return health.json["deliveries"]


@NEEDS_HANDOFF
async def test_kept_alive_connection_moves_once_then_is_served_by_the_holder(handoff_cluster):
    c = await handoff_cluster(2)
    cookie = await _seed(c, 0)
    connection = await RawConnection.to(c[1].public_path)
    try:
        status, headers, body = await connection.call("POST", "/touch", cookie)
        assert status == 200 and body["count"] == 1
        assert headers["x-gym-worker"] == c[0].id
        assert headers["x-gym-handed-over-by"] == c[1].id
        assert "x-gym-forwarded-by" not in headers
        for count in range(2, 6):
            status, headers, body = await connection.call("POST", "/touch", cookie)
            assert status == 200 and body["count"] == count
            # Served where the connection now is: no hop, no second handoff.
            assert headers["x-gym-worker"] == c[0].id
            assert "x-gym-handed-over-by" not in headers
            assert "x-gym-forwarded-by" not in headers
    finally:
        await connection.close()
    assert await _deliveries(c, 1) == {
        "handed_over": 1,
        "hopped": 0,
        "hop_reasons": {},
        "undecided": 0,
    }
    assert (await _deliveries(c, 0))["handed_over"] == 0


@NEEDS_HANDOFF
async def test_by_default_a_connection_moves_from_its_second_request(handoff_cluster):
    c = await handoff_cluster(2, handoff_from_request=2)
    cookie = await _seed(c, 0)
    one_shot = await c[1].request("POST", "/touch", cookie=cookie)  # a new connection
    assert one_shot.headers["x-gym-forwarded-by"] == c[1].id
    connection = await RawConnection.to(c[1].public_path)
    try:
        replies = [await connection.call("POST", "/touch", cookie) for _ in range(3)]
    finally:
        await connection.close()
    assert [body["count"] for _, _, body in replies] == [2, 3, 4]
    assert replies[0][1]["x-gym-forwarded-by"] == c[1].id
    assert replies[1][1]["x-gym-handed-over-by"] == c[1].id
    assert "x-gym-handed-over-by" not in replies[2][1]
    assert "x-gym-forwarded-by" not in replies[2][1]
    assert await _deliveries(c, 1) == {
        "handed_over": 1,
        "hopped": 2,
        "hop_reasons": {"first_request": 2},
        "undecided": 0,
    }


@NEEDS_HANDOFF
async def test_a_connection_carrying_many_sessions_moves_once_per_rest_then_hops(
    handoff_cluster,
):
    # A pool's connection (nginx keepalive, aiohttp): each request may name a
    # session of another worker. Handed over at every such request it would
    # move each time (issue 32: 4.2x a 1-worker server, against 2.6x hopping).
    c = await handoff_cluster(3)
    again = AGAIN_FROM_REQUEST
    cookies = [await _seed(c, index) for index in range(3)]
    connection = await RawConnection.to(c[0].public_path)
    at, begun, handed_in = 0, 0, False  # the worker holding the connection, its requests there
    moves: list[int] = []
    hops = 0
    try:
        for n in range(40):
            index = (2, 1, 0, 1)[n % 4]
            status, headers, _ = await connection.call("POST", "/touch", cookies[index])
            assert status == 200 and headers["x-gym-worker"] == c[index].id
            begun += 1
            if index == at:
                assert "x-gym-handed-over-by" not in headers
                assert "x-gym-forwarded-by" not in headers
            elif handed_in and begun < again:
                # Moved here less than `again` requests ago: it stays, the request hops.
                assert headers["x-gym-forwarded-by"] == c[at].id, (n, headers)
                assert "x-gym-handed-over-by" not in headers
                hops += 1
            else:
                assert headers["x-gym-handed-over-by"] == c[at].id, (n, headers)
                assert "x-gym-forwarded-by" not in headers
                moves.append(n)
                at, begun, handed_in = index, 1, True
        counts = [c[index].server.counts for index in range(3)]
        assert [next(iter(count.values())) for count in counts] == [10, 20, 10]
    finally:
        await connection.close()
    # The first request moves it (these clusters hand over from a first request),
    # and then once every `again - 1` requests.
    assert moves == [0, 15, 30]
    assert c[0].app.handoff.again_from_request == again
    health = [await _deliveries(c, index) for index in range(3)]
    assert sum(h["handed_over"] for h in health) == len(moves)
    assert sum(h["hop_reasons"].get("moved_recently", 0) for h in health) == hops
    assert sum(h["hopped"] for h in health) == hops


@NEEDS_HANDOFF
async def test_a_connection_handed_in_follows_its_session_after_the_rest(handoff_cluster):
    # One session per connection, its holder changing (a close and a start placed
    # elsewhere, a restore): the connection follows it again, after the rest.
    c = await handoff_cluster(3)
    again = AGAIN_FROM_REQUEST
    first, second = await _seed(c, 1), await _seed(c, 2)
    connection = await RawConnection.to(c[0].public_path)
    try:
        status, headers, _ = await connection.call("POST", "/touch", first)
        assert status == 200 and headers["x-gym-handed-over-by"] == c[0].id
        for _ in range(again - 2):
            status, headers, _ = await connection.call("POST", "/touch", second)
            assert status == 200 and headers["x-gym-forwarded-by"] == c[1].id
        status, headers, _ = await connection.call("POST", "/touch", second)
        assert status == 200 and headers["x-gym-handed-over-by"] == c[1].id
        status, headers, _ = await connection.call("POST", "/touch", second)
        assert status == 200 and headers["x-gym-worker"] == c[2].id
        assert "x-gym-forwarded-by" not in headers and "x-gym-handed-over-by" not in headers
    finally:
        await connection.close()
    assert (await _deliveries(c, 1))["hop_reasons"] == {"moved_recently": again - 2}


@NEEDS_HANDOFF
async def test_pipelined_requests_are_hopped_until_none_is_buffered(handoff_cluster):
    c = await handoff_cluster(2)
    cookie = await _seed(c, 0)
    connection = await RawConnection.to(c[1].public_path)
    touch = RawConnection.request("POST", "/touch", cookie)
    try:
        await connection.send(touch, touch, touch)
        replies = [await connection.reply() for _ in range(3)]
    finally:
        await connection.close()
    assert [body["count"] for _, _, body in replies] == [1, 2, 3]
    # Behind the first two a further request was already read: hopped. The
    # last had nothing behind it: its connection was handed over.
    assert [h.get("x-gym-forwarded-by") for _, h, _ in replies] == [c[1].id, c[1].id, None]
    assert replies[2][1]["x-gym-handed-over-by"] == c[1].id
    assert await _deliveries(c, 1) == {
        "handed_over": 1,
        "hopped": 2,
        "hop_reasons": {"not_detachable": 2},
        "undecided": 0,
    }


@NEEDS_HANDOFF
async def test_health_counts_are_exact_for_a_known_load(handoff_cluster):
    c = await handoff_cluster(3)
    cookies = [await _seed(c, 0), await _seed(c, 2)]
    for _ in range(5):  # new connection per request: each is handed over
        for cookie in cookies:
            assert (await c[1].request("POST", "/touch", cookie=cookie)).status == 200
    # A connection that asks to close is not handed over.
    closing = await c[1].request(
        "POST", "/touch", cookie=cookies[0], headers={"Connection": "close"}
    )
    assert closing.status == 200 and closing.headers["x-gym-forwarded-by"] == c[1].id
    assert await _deliveries(c, 1) == {
        "handed_over": 10,
        "hopped": 1,
        "hop_reasons": {"not_detachable": 1},
        "undecided": 0,
    }
    assert c[0].server.counts[next(iter(c[0].server.counts))] == 6


@NEEDS_HANDOFF
async def test_holder_that_closes_its_handoff_socket_unanswered_gets_the_hop(
    handoff_cluster, short_tmp
):
    """A holder that dies holding the descriptor, before it answers, served nothing: hop."""
    c = await handoff_cluster(2)
    cookie = await _seed(c, 0)
    await c[0].app.handoff_listener.stop()
    path = c.runtime_dir.handoff_path(c[0].id)
    dying = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    dying.bind(path)
    dying.listen()
    dying.setblocking(False)
    loop = asyncio.get_running_loop()
    taken: list[int] = []

    async def take_and_die() -> None:
        peer, _ = await loop.sock_accept(dying)
        while True:
            try:
                _, fds, _, _ = socket.recv_fds(peer, 1 << 18, 4)
                break
            except BlockingIOError:
                await asyncio.sleep(0.01)
        taken.extend(fds)
        for fd in fds:
            os.close(fd)
        peer.close()  # no answer: as the kernel does for a killed process

    stand_in = asyncio.create_task(take_and_die())
    try:
        reply = await c[1].request("POST", "/touch", cookie=cookie)
        await stand_in
    finally:
        dying.close()
    assert len(taken) == 1
    assert reply.status == 200 and reply.json["count"] == 1
    assert reply.headers["x-gym-forwarded-by"] == c[1].id
    assert (await _deliveries(c, 1))["hop_reasons"] == {"lost": 1}


@NEEDS_HANDOFF
async def test_handoff_to_a_worker_without_the_session_is_refused_and_hopped(handoff_cluster):
    c = await handoff_cluster(2)
    cookie = await _seed(c, 0)
    c[0].app.claims.accepting_sessions = False  # draining: keeps its sessions, takes no connection
    reply = await c[1].request("POST", "/touch", cookie=cookie)
    assert reply.status == 200 and reply.headers["x-gym-forwarded-by"] == c[1].id
    assert (await _deliveries(c, 1))["hop_reasons"] == {"refused": 1}


# The listener's own checks -----------------------------------------------------------------


@pytest.fixture
async def listener(short_tmp):
    path = os.path.join(short_tmp, "h.fds")
    taken: list[str] = []

    def takes(session_id: str) -> bool:
        taken.append(session_id)
        return True

    made = HandoffListener(path, takes)
    made.attach(lambda: pytest.fail("nothing may be served"), lambda: True)
    await made.start()
    yield made, taken
    await made.stop()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _ask(path: str, message: bytes, fds: list[int]) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asker:
        asker.connect(path)
        asker.sendmsg(
            [message],
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else [],
        )
        asker.setblocking(False)
        return await asyncio.get_running_loop().sock_recv(asker, 16)


@pytest.mark.parametrize("how", ["two_descriptors", "no_descriptor", "malformed", "too_large"])
async def test_listener_refuses_bad_messages_and_closes_every_descriptor(listener, how):
    made, taken = listener
    before = _open_fds()
    left, right = socket.socketpair()
    scope = {"method": "GET", "path": "/", "raw_path": b"/", "query_string": b"", "headers": []}
    message = pack_message("s1", "w-test", replay_bytes(scope, b""))
    fds = [left.fileno()]
    if how == "two_descriptors":
        fds = [left.fileno(), right.fileno()]
    elif how == "no_descriptor":
        fds = []
    elif how == "malformed":
        message = b"nonsense"
    else:
        message += b"x" * (200 * 1024)
    try:
        answer = await _ask(made.path, message, fds)
    finally:
        left.close()
        right.close()
    assert answer == ACK_REFUSED
    assert made.taken == 0 and taken == []
    # Whatever arrived was closed, and the asker's socket once it left.
    assert await wait_until(lambda: _open_fds() == before)


def test_listener_takes_nothing_from_another_uid(short_tmp):
    if os.getuid() != 0:
        pytest.skip("needs root to run a client as another uid")
    script = f"""
import asyncio, os, socket, sys
sys.path.insert(0, {os.getcwd()!r})
from gym_sessions.routing.handoff_listener import HandoffListener
from gym_sessions.server.env_server import GymEnvServer

async def main():
    path = {os.path.join(short_tmp, "h.fds")!r}
    listener = HandoffListener(path, lambda sid: True)
    listener.attach(lambda: None, lambda: True)
    await listener.start()
    os.chmod({short_tmp!r}, 0o755)
    os.chmod(path, 0o777)  # reachable, so only the peer check stands in the way
    child = await asyncio.create_subprocess_exec(sys.executable, "-c", '''
import os, socket, sys
os.setuid(65534)
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
a, b = socket.socketpair()
try:
    socket.send_fds(s, [b"GSH1" + bytes(4) + b"GET / HTTP/1.1\\\\r\\\\n\\\\r\\\\n"], [a.fileno()])
    print(repr(s.recv(16)))
except OSError as exc:
    print(type(exc).__name__)
''', path, stdout=asyncio.subprocess.PIPE)
    out, _ = await child.communicate()
    print(out.decode().strip(), listener.taken, listener.refused)
    await listener.stop()

asyncio.run(main())
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    # The peer's socket was closed unanswered (an empty read or a reset), nothing taken.
    answer, taken, refused = result.stdout.split()
    assert answer in ("b''", "ConnectionResetError", "BrokenPipeError")
    assert (taken, refused) == ("0", "0")


async def test_an_untested_uvicorn_turns_handoff_off(handoff_cluster, monkeypatch):
    from gym_sessions.transport.http_protocol import BoundedHttpProtocol

    # What `uvicorn_tested()` gives on a uvicorn outside TESTED_UVICORN.
    monkeypatch.setattr(BoundedHttpProtocol, "handoff_enabled", False)
    c = await handoff_cluster(2)
    cookie = await _seed(c, 0)
    reply = await c[1].request("POST", "/touch", cookie=cookie)
    assert reply.status == 200 and reply.headers["x-gym-forwarded-by"] == c[1].id
    assert (await _deliveries(c, 1))["hop_reasons"] == {"protocol": 1}


def _counter_server() -> GymEnvServer:
    return GymEnvServer(CounterEnv, name="counter")


async def _start_counters(c: Cluster, index: int, count: int) -> list[str]:
    cookies = []
    for k in range(count):
        body = {"resources_session_id": new_id(), "options": {"initial_count": 10 * k}}
        start = await c[index].request("POST", "/reset", body)
        assert start.status == 200 and start.cookie is not None
        cookies.append(start.cookie)
    return cookies


async def _batch(connection: RawConnection, cookies: list[str]) -> list[dict[str, Any]]:
    entries = [{"cookie": cookie, "action": 1} for cookie in cookies]
    body = json.dumps({"entries": entries}).encode()
    status, _, reply = await connection.call_with_body("POST", "/step_batch", body)
    assert status == 200, reply
    return reply["results"]


@NEEDS_HANDOFF
async def test_a_step_batch_held_by_one_other_worker_moves_its_connection_there(start_clusters):
    c = await start_clusters(_counter_server, 2, handoff=True)
    cookies = await _start_counters(c, 0, 3)
    connection = await RawConnection.to(c[1].public_path)
    try:
        for step in (1, 2, 3):
            results = await _batch(connection, cookies)
            assert [r["observation"] for r in results] == [step, 10 + step, 20 + step]
            assert {r["worker"] for r in results} == {c[0].id}
    finally:
        await connection.close()
    # Moved with the first batch; the next two were served where it now is.
    assert await _deliveries(c, 1) == {
        "handed_over": 1,
        "hopped": 0,
        "hop_reasons": {},
        "undecided": 0,
    }


@NEEDS_HANDOFF
async def test_a_step_batch_of_several_holders_stays_and_hops_its_sub_batches(start_clusters):
    c = await start_clusters(_counter_server, 3, handoff=True)
    cookies = (await _start_counters(c, 0, 2)) + (await _start_counters(c, 2, 1))
    connection = await RawConnection.to(c[1].public_path)
    try:
        for step in (1, 2):
            results = await _batch(connection, cookies)
            assert [r["observation"] for r in results] == [step, 10 + step, step]
            assert [r["worker"] for r in results] == [c[0].id, c[0].id, c[2].id]
    finally:
        await connection.close()
    assert (await _deliveries(c, 1))["handed_over"] == 0


# Answers under load: one owner per connection (issue 27) -----------------------------------


#: Questions the slow asker sends: more answers than fit a Unix socket's send buffer (about 270).
COUNT = 800


def _question() -> bytes:
    scope = {"method": "GET", "path": "/", "raw_path": b"/", "query_string": b"", "headers": []}
    return pack_message("s1", "w-test", replay_bytes(scope, b""))


class _Served(asyncio.Protocol):
    """Stands in for the public server's protocol on the holder: records what it got."""

    def __init__(self, served: list[object]) -> None:
        self.served = served

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.served.append(transport)

    def expect_replay(self, sender: str) -> None:
        pass

    def data_received(self, data: bytes) -> None:
        pass


async def test_a_slow_asker_gets_every_answer_and_each_connection_one_owner(short_tmp):
    """The holder answers faster than the asker reads: no answer may be lost or guessed.

    The holder runs on its own loop in a thread; the asker's loop is busy
    sending (as a loaded worker is) and reads no answer until all are sent,
    so several hundred answers wait in the holder's socket buffer. Before
    the fix the holder closed its socket when the buffer filled, and the
    asker took every open question as "lost" and would have served the
    connections the holder was serving.
    """
    path = os.path.join(short_tmp, "h.fds")
    served: list[object] = []
    holder_loop = asyncio.new_event_loop()
    thread = threading.Thread(target=holder_loop.run_forever, daemon=True)
    thread.start()
    listener = HandoffListener(path, lambda session_id: True)
    listener.attach(lambda: _Served(served), lambda: True)
    asyncio.run_coroutine_threadsafe(listener.start(), holder_loop).result(10)
    clients = [socket.socketpair() for _ in range(COUNT)]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    sock.setblocking(False)
    channel = _Channel(sock, asyncio.get_running_loop())
    answers: list[asyncio.Future[bool]] = []
    try:
        message = _question()
        for left, _ in clients:
            # Until the holder's socket stays full: then a worker hops (nothing was sent).
            for _attempt in range(50):  # bounded: the holder's thread reads on meanwhile
                try:
                    answers.append(channel.send(message, left.fileno()))
                    break
                except BlockingIOError:
                    # Blocking on purpose: this loop is the busy asker's.
                    time.sleep(0.002)  # noqa: ASYNC251
            else:
                break
        settled = await asyncio.wait_for(asyncio.gather(*answers, return_exceptions=True), 30)
        # More answers than the holder's socket buffer holds had to wait for this reader.
        assert len(answers) > 300
        assert settled == [True] * len(answers)
        assert await wait_until(lambda: len(served) == len(answers))
        assert listener.taken == len(answers) and listener.refused == 0
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(listener.stop(), holder_loop).result(10)
        for transport in served:
            holder_loop.call_soon_threadsafe(transport.abort)  # type: ignore[attr-defined]
        holder_loop.call_soon_threadsafe(holder_loop.stop)
        thread.join(10)
        holder_loop.close()
        for left, right in clients:
            left.close()
            right.close()


async def test_answers_written_before_the_holder_closed_are_still_read(short_tmp):
    """A holder that closes with questions unread still said "taken" to the ones it answered.

    Linux reports that close to the asker as a reset before the answers
    queued for it; the answered questions are taken (the holder serves
    them), only the rest are lost (their descriptors went with its socket).
    """
    path = os.path.join(short_tmp, "h.fds")
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    holder.bind(path)
    holder.listen()
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    asker.connect(path)
    asker.setblocking(False)
    peer, _ = holder.accept()
    channel = _Channel(asker, asyncio.get_running_loop())
    left, right = socket.socketpair()
    try:
        answers = [channel.send(_question(), left.fileno()) for _ in range(5)]
        for _ in range(3):
            _, fds, _, _ = socket.recv_fds(peer, 1 << 18, 4)
            for fd in fds:
                os.close(fd)
            peer.send(ACK_TAKEN)
        peer.close()  # two questions still unread in its socket
        settled = await asyncio.wait_for(asyncio.gather(*answers, return_exceptions=True), 10)
    finally:
        channel.close()
        holder.close()
        left.close()
        right.close()
    assert settled[:3] == [True, True, True]
    assert [type(error) for error in settled[3:]] == [HandoffLost, HandoffLost]


async def test_an_answer_the_asker_can_no_longer_read_lets_the_connection_go(short_tmp):
    """Closing the channel with a question open: undecided, never taken for "served nothing"."""
    path = os.path.join(short_tmp, "h.fds")
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    holder.bind(path)
    holder.listen()
    asker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    asker.connect(path)
    asker.setblocking(False)
    channel = _Channel(asker, asyncio.get_running_loop())
    left, right = socket.socketpair()
    try:
        answer = channel.send(_question(), left.fileno())
        channel.close()
        with pytest.raises(HandoffUndecided):
            await answer
    finally:
        holder.close()
        left.close()
        right.close()
