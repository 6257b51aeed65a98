"""Private TCP listeners (Redis claims) are bounded like public ones (#20 item 5).

In-process workers with Redis claims, reached on their real private TCP ports:
request heads are bounded before the signature is checked, silent, half-sent
and idle connections close, and a flood of connections stays under the cap
while peers' signed forwards and the public side carry on.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

from gym_sessions.routing import stream_forwarder
from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.settings import Settings
from gym_sessions.transport import private_listener

from .cluster import SECRET, Cluster, Worker, new_id, wait_until
from .probe_server import ProbeServer

MIB = 1024 * 1024
# A wait for an event ends when it comes; only a hang lasts this long.
_HANG_GUARD = 60.0
STARTS = ("/seed_session", "/reset", "/blind_start")


@pytest.fixture
def hosts(start_clusters, redis_server):
    async def make(n: int = 2, **kw) -> Cluster:
        kw.setdefault("checkpoint_session_starts", STARTS)
        return await start_clusters(ProbeServer, n, claims=redis_server.url, **kw)

    return make


def _address(worker: Worker) -> tuple[str, int]:
    listener = worker.app._listener
    assert listener is not None and listener.address is not None
    return listener.address


def _open_connections(worker: Worker) -> int:
    """Connections the worker's private listener holds now."""
    listener = worker.app._listener
    assert listener is not None
    return len(listener._state.connections)


async def _start(worker: Worker) -> tuple[str, str]:
    sid = new_id()
    reply = await worker.request("POST", "/seed_session", {"resources_session_id": sid})
    assert reply.status == 200, reply.json
    assert reply.cookie is not None
    return sid, reply.cookie


def _signed_request(worker: Worker, target: str, cookie: str, body: bytes = b"{}") -> bytes:
    """A request to ``worker``'s private listener signed as a peer would (kept alive)."""
    headers = [(b"host", b"worker"), (b"cookie", f"gym_session={cookie}".encode())]
    path, _, query = target.partition("?")
    scope = {
        "method": "POST",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "headers": headers,
    }
    signature = ForwardSigner(SECRET).header(scope, body, worker.id)
    lines = [f"POST {target} HTTP/1.1\r\n".encode()]
    lines += [name + b": " + value + b"\r\n" for name, value in [*headers, signature]]
    lines.append(f"content-length: {len(body)}\r\n\r\n".encode())
    return b"".join(lines) + body


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_until_refused(
    address: tuple[str, int], head: bytes, filler: bytes, total: int
) -> tuple[int, bytes]:
    """Send ``head`` then ``filler`` until ``total`` bytes or the listener stops reading.

    Blocking (run it in a thread: the listener is on this process's loop).
    Returns how many bytes went out and what the listener answered.
    """
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(head)
        sent = len(head)
        try:
            while sent < total:
                sock.sendall(filler)
                sent += len(filler)
        except OSError:  # answered and closed: the rest is never read
            pass
        reply = b""
        try:
            while chunk := sock.recv(65536):
                reply += chunk
        except OSError:
            pass
    return sent, reply


# Heads ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "head", "filler"),
    [
        ("one huge header value", b"POST /touch HTTP/1.1\r\nHost: x\r\nX-Big: ", b"a" * 65536),
        ("many tiny header lines", b"POST /touch HTTP/1.1\r\nHost: x\r\n", b"a: b\r\n" * 10000),
        ("a huge URL", b"POST /touch?", b"q" * 65536),
    ],
)
async def test_an_unsigned_head_over_the_limit_gets_431_as_it_crosses_it(hosts, kind, head, filler):
    c = await hosts(2)
    address = _address(c[0])
    rss_before = _rss_kib()
    # Four at once, 64 MiB each (unsigned: the router never sees them).
    results = await asyncio.gather(
        *(asyncio.to_thread(_send_until_refused, address, head, filler, 64 * MIB) for _ in range(4))
    )
    for sent, reply in results:
        assert reply.startswith(b"HTTP/1.1 431 "), (kind, sent, reply[:200])
        assert b'"code": "headers_too_large"' in reply and b"connection: close" in reply.lower()
        # Refused at ~64 KiB: far fewer than 64 MiB went out (socket buffers aside).
        assert sent < 16 * MIB, (kind, sent)
    assert _rss_kib() - rss_before < 32 * 1024, kind  # this process holds the listener
    assert await wait_until(lambda: _open_connections(c[0]) == 0)
    # The worker carries on: a peer's signed forward is served.
    _, cookie = await _start(c[0])
    touched = await c[1].request("POST", "/touch", cookie=cookie)
    assert touched.status == 200 and touched.json["worker"] == c[0].id


async def _send_in_pieces(worker: Worker, request: bytes) -> bytes:
    """Send ``request`` 4 KiB at a time (read in pieces, so counted); the reply's first line."""
    reader, writer = await asyncio.open_connection(*_address(worker))
    try:
        for start in range(0, len(request), 4096):
            writer.write(request[start : start + 4096])
            await writer.drain()
            await asyncio.sleep(0.001)
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()


@pytest.mark.parametrize("public_limit", [None, 16 * 1024])
async def test_the_bound_admits_what_a_public_listener_admits_plus_the_hop(hosts, public_limit):
    """A head at the public limit plus the signature fits; a few KiB more do not.

    The private bound follows ``max_header_bytes`` (default 64 KiB).
    """
    limit = public_limit or Settings().max_header_bytes
    c = await (hosts(2, max_header_bytes=public_limit) if public_limit else hosts(2))
    sid, cookie = await _start(c[0])
    bare = len(_signed_request(c[0], "/touch?q=", cookie)) - len(b"{}")
    target = "/touch?q=" + "q" * (limit + 200 - bare)
    request = _signed_request(c[0], target, cookie)
    assert len(request) - len(b"{}") == limit + 200
    status_line = await _send_in_pieces(c[0], request)
    assert status_line.startswith(b"HTTP/1.1 200 "), status_line
    # Past the limit, signed or not: refused as it crosses it (the router never sees it).
    target += "q" * (8 * 1024)
    status_line = await _send_in_pieces(c[0], _signed_request(c[0], target, cookie))
    assert status_line.startswith(b"HTTP/1.1 431 "), status_line
    assert c[0].server.counts[sid] == 1


async def test_unsigned_upgrade_requests_are_refused_without_a_log_line_each(hosts, caplog):
    c = await hosts(2)
    for _ in range(3):
        reader, writer = await asyncio.open_connection(*_address(c[0]))
        writer.write(
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n"
        )
        reply = await asyncio.wait_for(reader.read(), 5)
        assert reply.startswith(b"HTTP/1.1 403 "), reply
        writer.close()
    assert [r.getMessage() for r in caplog.records if r.name == "uvicorn.error"] == []


# Timeouts ---------------------------------------------------------------------------------


async def test_silent_half_sent_and_idle_connections_are_closed_within_their_timeouts(
    hosts, monkeypatch
):
    # Forwarders close pooled connections well before the listener does by default.
    idle_default = Settings().private_idle_timeout
    assert idle_default <= 60
    assert idle_default >= stream_forwarder._IDLE_CLOSE_SECONDS * 2
    monkeypatch.setattr(private_listener, "_HEAD_TIMEOUT_SECONDS", 0.5)
    c = await hosts(2, private_idle_timeout=1.0)
    _, cookie = await _start(c[0])
    address = _address(c[0])
    began = time.monotonic()
    silent = [await asyncio.open_connection(*address) for _ in range(5)]
    half = [await asyncio.open_connection(*address) for _ in range(5)]
    for _, writer in half:
        writer.write(b"POST /touch HTTP/1.1\r\nHost: x\r\nContent-Le")
    kept_reader, kept_writer = await asyncio.open_connection(*address)
    kept_writer.write(_signed_request(c[0], "/touch", cookie))  # no connection: close

    async def until_closed(reader: asyncio.StreamReader) -> bytes:
        return await asyncio.wait_for(reader.read(), 5)  # everything, up to the listener's close

    silent_replies = await asyncio.gather(*(until_closed(reader) for reader, _ in silent))
    half_replies = await asyncio.gather(*(until_closed(reader) for reader, _ in half))
    assert silent_replies == [b""] * 5  # closed without a word
    for reply in half_replies:
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b'"code": "request_timeout"' in reply
    assert time.monotonic() - began < 3
    # The signed request was served, then its idle kept-alive connection closed.
    kept = await until_closed(kept_reader)
    assert (
        kept.startswith(b"HTTP/1.1 200 ")
        and json.loads(kept.partition(b"\r\n\r\n")[2])["count"] == 1
    ), kept
    assert 1 <= time.monotonic() - began < 4
    assert await wait_until(lambda: _open_connections(c[0]) == 0)
    for _, writer in [*silent, *half, (kept_reader, kept_writer)]:
        writer.close()


# The connection cap -----------------------------------------------------------------------


class _Flood:
    """Opens silent (and half-sent) connections to ``address`` without end, in the background."""

    def __init__(self, address: tuple[str, int], pause: float = 0.002) -> None:
        self.address = address
        self.pause = pause
        self.writers: list[asyncio.StreamWriter] = []
        self.readers: list[asyncio.StreamReader] = []
        self.task: asyncio.Task[None] | None = None

    async def open(self, n: int) -> None:
        for i in range(n):
            reader, writer = await asyncio.open_connection(*self.address)
            if i % 2:
                writer.write(b"POST /touch HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            self.readers.append(reader)
            self.writers.append(writer)
            await asyncio.sleep(self.pause)

    def closed(self) -> int:
        """Connections the listener closed: at their end, or reset (unread bytes, on Linux)."""
        return sum(reader.at_eof() or reader.exception() is not None for reader in self.readers)

    async def _run(self) -> None:
        while True:
            await self.open(1)

    def __enter__(self) -> _Flood:
        self.task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        for writer in self.writers:
            writer.close()


async def _most_open_while(worker: Worker, work) -> tuple[int, object]:
    """Run ``work`` while sampling the worker's open private connections; the most seen.

    Counts the connections the listener holds and is not closing. One that gave
    way to a new one is closed at once but leaves the listener's set only on the
    loop's next pass, and how many give way in one pass is how many the loop
    accepted in one go: more on a slow machine, so they are not counted. Checks on
    the way that the cap's count never passed its limit and that, closing ones
    included, no more than twice the limit were open (the listener accepts at most
    its backlog, the limit, in one go). Returns once every closing one has left.
    """
    most = 0
    done = asyncio.Event()
    listener = worker.app._listener
    cap = listener.connections
    assert cap is not None

    def live() -> int:
        return sum(not c.transport.is_closing() for c in listener._state.connections)

    async def sample() -> None:
        nonlocal most
        while not done.is_set():
            assert len(cap) <= cap.limit
            assert _open_connections(worker) <= 2 * cap.limit, _open_connections(worker)
            most = max(most, live())
            await asyncio.sleep(0.001)

    sampler = asyncio.create_task(sample())
    try:
        result = await work
    finally:
        done.set()
        await sampler
    assert await wait_until(lambda: _open_connections(worker) == live(), within=_HANG_GUARD)
    return most, result


async def test_a_connection_flood_stays_under_the_cap_and_peers_still_get_in(hosts, monkeypatch):
    assert Settings().private_max_connections == 256
    # Nothing but the cap closes a flood's connection while the test runs.
    monkeypatch.setattr(private_listener, "_HEAD_TIMEOUT_SECONDS", 3600.0)
    c = await hosts(2, private_max_connections=8, private_idle_timeout=3600.0)
    sid, cookie = await _start(c[0])
    # A pooled connection from the peer, before the flood.
    touched = await c[1].request("POST", "/touch", cookie=cookie)
    assert touched.status == 200 and touched.json["worker"] == c[0].id
    flood = _Flood(_address(c[0]))
    most, _ = await _most_open_while(c[0], flood.open(120))
    assert most <= 8, most
    # Beyond the cap connections are closed as new ones come, by the cap.
    assert await wait_until(lambda: flood.closed() >= 120 - 8, within=_HANG_GUARD), flood.closed()

    async def honest_traffic() -> list[int]:
        statuses = []
        for round_ in range(10):
            # Several at once: beyond the one pooled connection, new ones are needed.
            forwarded = await asyncio.gather(
                *(c[1].request("POST", "/touch", cookie=cookie) for _ in range(4))
            )
            assert all(r.json["worker"] == c[0].id for r in forwarded if r.status == 200)
            public = await c[0].request("POST", "/touch", cookie=cookie)  # its public side
            statuses += [r.status for r in forwarded] + [public.status]
            assert (await c[1].request("GET", "/health")).status == 200, round_
        return statuses

    with flood:  # and it goes on while peers forward
        most, statuses = await _most_open_while(c[0], honest_traffic())
    assert statuses == [200] * 50, statuses
    assert most <= 8, most
    assert c[0].server.counts[sid] == 1 + 50
    cap = c[0].app._listener.connections
    assert cap is not None and cap.evicted >= 112 and cap.refused == 0


async def test_at_the_cap_with_every_connection_busy_a_new_one_gets_503_unread(hosts):
    c = await hosts(2, private_max_connections=4)
    _, cookie = await _start(c[0])
    sleeps = asyncio.gather(
        *(c[1].request("POST", "/sleep", {"seconds": 1.0}, cookie=cookie) for _ in range(4))
    )
    assert await wait_until(lambda: _open_connections(c[0]) == 4)
    await asyncio.sleep(0.1)  # every head in and being answered
    reader, writer = await asyncio.open_connection(*_address(c[0]))  # sends nothing
    refused = await asyncio.wait_for(reader.read(), 2)
    assert refused.startswith(b"HTTP/1.1 503 "), refused
    assert b'"code": "overloaded"' in refused and b"retry-after: 1" in refused.lower()
    writer.close()
    assert [r.status for r in await sleeps] == [200] * 4
    # Once they are answered, new connections get in again (idle pooled ones give way).
    reader, writer = await asyncio.open_connection(*_address(c[0]))
    writer.write(_signed_request(c[0], "/touch", cookie))
    status_line = await asyncio.wait_for(reader.readline(), 5)
    assert status_line.startswith(b"HTTP/1.1 200 "), status_line
    writer.close()
    assert c[0].app._listener.connections.refused == 1


# Honest forwarding ------------------------------------------------------------------------


async def test_pooled_signed_forwarding_from_several_peers_works_at_the_cap(hosts):
    c = await hosts(3, private_max_connections=4)
    sid, cookie = await _start(c[0])

    async def forwarding() -> list[int]:
        statuses = []
        # c[1] fills the cap with pooled connections (4 at once), then c[2] needs one.
        replies = await asyncio.gather(
            *(c[1].request("POST", "/sleep", {"seconds": 0.2}, cookie=cookie) for _ in range(4))
        )
        statuses += [r.status for r in replies]
        for _ in range(10):
            for peer in (c[2], c[1], c[1], c[2]):
                reply = await peer.request("POST", "/touch", cookie=cookie)
                assert reply.json["worker"] == c[0].id
                statuses.append(reply.status)
            replies = await asyncio.gather(
                *(peer.request("POST", "/touch", cookie=cookie) for peer in (c[1], c[2], c[1]))
            )
            statuses += [r.status for r in replies]
        return statuses

    most, statuses = await _most_open_while(c[0], forwarding())
    assert statuses == [200] * (4 + 10 * 7), statuses
    assert most <= 4, most
    assert c[0].server.counts[sid] == 10 * 7
    cap = c[0].app._listener.connections
    assert cap is not None and cap.refused == 0


async def test_sequential_forwards_reuse_one_pooled_connection(hosts):
    c = await hosts(2)
    _, cookie = await _start(c[0])
    for _ in range(30):
        reply = await c[1].request("POST", "/touch", cookie=cookie)
        assert reply.status == 200 and reply.json["worker"] == c[0].id
    assert _open_connections(c[0]) == 1
    cap = c[0].app._listener.connections
    assert cap is not None and cap.limit == private_listener.default_max_connections()
    assert cap.evicted == 0 and cap.refused == 0
