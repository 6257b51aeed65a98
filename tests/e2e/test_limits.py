"""Nothing unbounded, with real servers: request heads, bodies, open sessions, idle sessions.

Each attack runs beside an honest counter episode that must still score 1.0.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections import Counter

import pytest

from envs.counter_load import client_session, make_episodes, play
from tests.stress.scenarios import worker_healths

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
MIB = 1024 * 1024


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks


def _send_until_refused(port: int, head: bytes, filler: bytes, total: int) -> tuple[int, bytes]:
    """Send ``head`` then ``filler`` until ``total`` bytes or the server stops reading.

    Returns how many bytes went out and what the server answered.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        sent = len(head)
        try:
            while sent < total:
                sock.sendall(filler)
                sent += len(filler)
        except OSError:  # the server answered and closed: the rest is never read
            pass
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    return sent, reply


class _Honest:
    """Counter episodes played in a thread while an attack runs; all must score 1.0."""

    def __init__(self, url: str, n: int = 20) -> None:
        self.episodes = make_episodes(n, seed=random.randrange(2**32))  # fresh ids each time
        self.thread = threading.Thread(target=self._run, args=(url,))

    def _run(self, url: str) -> None:
        async def main() -> None:
            async with client_session() as client:
                for episode in self.episodes:
                    await play(client, url, episode)

        asyncio.run(main())

    def __enter__(self) -> _Honest:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.thread.join(120)
        assert [e.reward for e in self.episodes] == [1.0] * len(self.episodes)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gym_sessions.server.process import start_server

    started = start_server(
        COUNTER,
        "--header-timeout",
        "2",
        workers=4,
        tmpdir=str(tmp_path_factory.mktemp("limits", numbered=True)),
    )
    yield started
    started.stop()


@pytest.mark.parametrize(
    ("kind", "head", "filler"),
    [
        ("one huge header value", b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 65536),
        ("many tiny header lines", b"GET /health HTTP/1.1\r\nHost: x\r\n", b"a: b\r\n" * 10000),
        ("a huge URL", b"GET /health?", b"q" * 65536),
    ],
)
def test_a_head_over_the_limit_is_refused_as_it_crosses_it(server, kind, head, filler):
    pids = server.worker_pids()
    rss_before = {pid: _rss_kib(pid) for pid in pids}
    cpu_before = sum(_cpu_seconds(pid) for pid in pids)
    with _Honest(server.url):
        sent, reply = _send_until_refused(_port(server.url), head, filler, 64 * MIB)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b'"code": "headers_too_large"' in reply and b"connection: close" in reply.lower()
    # Refused at the limit: far fewer than 64 MiB were taken in (socket buffers aside).
    assert sent < 16 * MIB, (kind, sent)
    for pid in pids:
        assert _rss_kib(pid) - rss_before[pid] < 32 * 1024, kind  # < 32 MiB per worker
    assert sum(_cpu_seconds(pid) for pid in pids) - cpu_before < 5.0


def test_a_head_that_stalls_gets_408_and_a_silent_connection_is_closed(server):
    port = _port(server.url)
    with _Honest(server.url), socket.create_connection(("127.0.0.1", port), timeout=20) as half:
        half.sendall(b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Le")
        with socket.create_connection(("127.0.0.1", port), timeout=20) as silent:
            began = time.monotonic()
            reply = half.recv(65536)
            assert reply.startswith(b"HTTP/1.1 408 "), reply
            assert b'"code": "request_timeout"' in reply
            assert silent.recv(65536) == b""  # closed without a word
            assert time.monotonic() - began < 10
        assert half.recv(65536) == b""


def test_a_body_over_the_default_limit_gets_413(server):
    head = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (17 * MIB)
    _, reply = _send_until_refused(_port(server.url), head, b"{}," * 20000, 17 * MIB)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b'"code": "body_too_large"' in reply


def test_a_burst_of_starts_fills_every_worker_then_503(serve):
    n = 6
    capped = serve(COUNTER, "--max-sessions", str(n), workers=4)

    async def main():
        async with client_session() as client:

            async def start() -> tuple[int, dict, str]:
                body = {"options": {"initial_count": 0}}
                async with client.post(capped.url + "/reset", json=body) as reply:
                    return reply.status, await reply.json(), reply.headers.get("retry-after")

            first = await asyncio.gather(*[start() for _ in range(4 * n)])
            healths = await worker_healths(capped, 4)
            extra = await start()
            return first, healths, extra

    first, healths, extra = asyncio.run(main())
    assert [status for status, _, _ in first] == [200] * (4 * n), first
    assert sorted(h["open_sessions"] for h in healths.values()) == [n] * 4
    assert all(h["max_sessions"] == n for h in healths.values())
    status, body, retry_after = extra
    assert status == 503 and body["error"]["code"] == "capacity_reached"
    assert retry_after == "5"


def test_an_abandoned_session_expires(serve):
    idle = serve(COUNTER, "--session-idle-timeout", "1", workers=2)

    async def main():
        async with client_session(fresh_connections=False) as client:
            body = {"options": {"initial_count": 0}}
            async with client.post(idle.url + "/reset", json=body) as reply:
                cookie = reply.cookies["gym_session"].value
            headers = {"Cookie": f"gym_session={cookie}"}
            async with client.post(idle.url + "/step", json={"action": 1}, headers=headers) as r:
                assert r.status == 200
            await asyncio.sleep(2.5)  # the idle timeout, plus a sweep
            async with client.post(idle.url + "/step", json={"action": 1}, headers=headers) as r:
                return r.status, await r.json(), await worker_healths(idle, 2)

    status, body, healths = asyncio.run(main())
    assert status == 410 and body["error"]["code"] == "session_expired"
    assert sum(h["expired_sessions"] for h in healths.values()) == 1
    assert sum(h["open_sessions"] for h in healths.values()) == 0


def test_large_bodies_on_a_kept_alive_connection_are_not_taken_for_heads(server):
    """Body bytes (even the chunk that ends a message) never count toward the head limit."""
    pad = "x" * (3 * MIB)
    with socket.create_connection(("127.0.0.1", _port(server.url)), timeout=30) as sock:
        for index in range(3):
            body = b'{"options": {"initial_count": %d}, "pad": "%s"}' % (index, pad.encode())
            head = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
            sock.sendall(head + body)
            reply = b""
            while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, reply
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]


@pytest.mark.parametrize("pooled", [False, True], ids=["new-connections", "pooled"])
def test_a_burst_of_starts_is_balanced_over_the_workers(serve, pooled):
    # Without balanced placement (the default) the kernel hands most of a
    # burst's connections to one or two workers (benchmarks/placement.py:
    # [0, 6, 188, 206] seen); every worker must get a real share now.
    starts = 200
    balanced = serve(COUNTER, "--debug-worker-header", workers=4)

    async def main():
        async with client_session(fresh_connections=not pooled, limit=16) as client:

            async def start() -> tuple[int, str | None]:
                body = {"options": {"initial_count": 0}}
                async with client.post(balanced.url + "/reset", json=body) as reply:
                    await reply.read()
                    return reply.status, reply.headers.get("x-gym-worker")

            replies = await asyncio.gather(*[start() for _ in range(starts)])
        return replies, await worker_healths(balanced, 4)

    replies, healths = asyncio.run(main())
    assert [status for status, _ in replies] == [200] * starts
    placed = Counter(worker for _, worker in replies)
    assert len(healths) == 4 and sum(placed.values()) == starts
    assert {w: h["open_sessions"] for w, h in healths.items()} == dict(placed)
    assert min(placed.values()) >= starts // 16, placed  # a quarter of a fair share at least


def test_local_placement_opens_each_session_on_the_worker_its_connection_reached(serve):
    # --placement local: a start opens its session where it arrived, never placed.
    server = serve(COUNTER, "--placement", "local", "--debug-worker-header", workers=4)
    body = b'{"options": {"initial_count": 0}}'
    reset = b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", _port(server.url)), timeout=30) as sock:
            accepted = _exchange(sock, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            worker = json.loads(accepted.split(b"\r\n\r\n", 1)[1])["worker"]
            for _ in range(5):
                reply = _exchange(sock, reset)
                assert reply.startswith(b"HTTP/1.1 200 "), reply[:300]
                assert f"x-gym-worker: {worker}\r\n".encode() in reply.lower(), reply[:300]


def _exchange(sock: socket.socket, request: bytes) -> bytes:
    """One request and its whole reply (JSON bodies with a content-length) on ``sock``."""
    sock.sendall(request)
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = sock.recv(65536)
        assert chunk, reply
        reply += chunk
    head, _, rest = reply.partition(b"\r\n\r\n")
    length = int(
        next(
            line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
        ).split(b":")[1]
    )
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, reply
        rest += chunk
    return head + b"\r\n\r\n" + rest
