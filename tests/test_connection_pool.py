"""`ConnectionPool`'s choice of connection, against a scripted server that sends our hints.

The server names the worker of each connection by accept order (``w0``,
``w1``, ... round robin), serves a request for the session holder its
``x-holder`` header names, and answers with the hint headers a real worker
sends (`HOLDER_HEADER`, and `RELAYED_BY_HEADER` when the connection's worker
is another). With ``moves`` it also does what connection handoff does: a
connection that already served a request moves to the holder of the next one
it carries for another worker. The real server's side of the same contract
is tested in tests/unit/test_worker_hints.py and, with real workers and
`AsyncRemoteEnv`, in tests/e2e/test_handoff_e2e.py.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

import pytest

from gym_sessions.client import ConnectionPool
from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.exchange import TransportFailure
from gym_sessions.wire import HOLDER_HEADER, RELAYED_BY_HEADER


@dataclass
class Served:
    connection: int
    reached: str  # the worker the request arrived at
    holder: str


@dataclass
class HintingServer:
    workers: int
    moves: bool = False
    delay: float = 0.0
    close_after: set[int] = field(default_factory=set)  # request numbers to drop
    accept: list[str] = field(default_factory=list)  # workers of the first connections
    junk_after: set[int] = field(default_factory=set)  # requests answered with a reply too many
    seen: int = 0  # requests read so far
    served: list[Served] = field(default_factory=list)
    open_now: int = 0
    most_open: int = 0
    url: str = ""

    async def start(self) -> asyncio.Server:
        accepted = itertools.count()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            number = next(accepted)
            worker = (
                self.accept[number] if number < len(self.accept) else f"w{number % self.workers}"
            )
            requests_here = 0
            self.open_now += 1
            self.most_open = max(self.most_open, self.open_now)
            try:
                while head := await reader.readuntil(b"\r\n\r\n"):
                    fields = dict(
                        line.split(": ", 1) for line in head.decode().split("\r\n")[1:] if line
                    )
                    await reader.readexactly(int(fields.get("Content-Length", 0)))
                    number, self.seen = self.seen, self.seen + 1
                    if number in self.close_after:
                        return
                    holder = fields["x-holder"]
                    if self.moves and holder != worker and requests_here > 0:
                        worker = holder  # handed over: the holder reads it from now on
                    self.served.append(Served(number, worker, holder))
                    requests_here += 1
                    await asyncio.sleep(self.delay)
                    hints = f"{HOLDER_HEADER}: {holder}\r\n"
                    if worker != holder:
                        hints += f"{RELAYED_BY_HEADER}: {worker}\r\n"
                    reply = f"HTTP/1.1 200 OK\r\n{hints}Content-Length: 2\r\n\r\n{{}}"
                    if number in self.junk_after:  # in the same write: one more reply
                        reply += f"HTTP/1.1 200 OK\r\n{HOLDER_HEADER}: junk\r\n"
                        reply += "Content-Length: 2\r\n\r\n{}"
                    writer.write(reply.encode())
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                self.open_now -= 1
                writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return server


async def send(pool: ConnectionPool, holder: str, hint: str | None) -> str | None:
    """One request for ``holder``'s session, the pool told ``hint``; the holder it learned."""
    _, learned = await pool.round_trip(hint, "POST", "/step", {"x-holder": holder}, b"{}")
    return learned


@pytest.fixture
async def hinting():
    servers: list[asyncio.Server] = []

    async def make(**options) -> HintingServer:
        scripted = HintingServer(**options)
        servers.append(await scripted.start())
        return scripted

    yield make
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_each_session_is_sent_on_its_holders_connection_once_the_pool_has_one(hinting):
    server = await hinting(workers=3)
    pool = ConnectionPool(server.url)
    holders = ["w0", "w1", "w2"] * 4
    learned = {}
    for holder in holders[:3]:  # first contact: new connections w0, w1, w2 in turn
        learned[holder] = await send(pool, holder, None)
    assert learned == {"w0": "w0", "w1": "w1", "w2": "w2"}
    for holder in holders:
        await send(pool, holder, learned[holder])
    assert all(s.reached == s.holder for s in server.served[3:])
    assert pool.open_connections == 3 and pool.idle_by_worker() == {"w0": 1, "w1": 1, "w2": 1}
    await pool.close()


async def test_a_spare_connection_is_offered_to_a_holder_that_has_none_and_moves(hinting):
    # Every connection is accepted by w0 (one accepting worker); w1's session
    # gets w0's spare connection, which the server moves to w1 for good.
    server = await hinting(workers=1, moves=True)
    pool = ConnectionPool(server.url)
    await asyncio.gather(send(pool, "w0", "w0"), send(pool, "w0", "w0"))  # two on w0
    assert pool.idle_by_worker() == {"w0": 2}
    assert await send(pool, "w1", "w1") == "w1"
    assert pool.idle_by_worker() == {"w0": 1, "w1": 1}
    for _ in range(3):
        await send(pool, "w1", "w1")
        await send(pool, "w0", "w0")
    assert all(s.reached == s.holder for s in server.served)
    assert pool.open_connections == 2
    await pool.close()


async def test_where_connections_do_not_move_a_new_one_is_opened_instead(hinting):
    # No handoff: the spare offered to w1 stays w0's (relayed), so the next
    # request for w1 opens a connection, which lands on w1.
    server = await hinting(workers=2, accept=["w0", "w0", "w1"])
    pool = ConnectionPool(server.url)
    await asyncio.gather(send(pool, "w0", "w0"), send(pool, "w0", "w0"))  # two on w0
    await send(pool, "w1", "w1")  # the spare: relayed
    assert pool.idle_by_worker() == {"w0": 2}
    await send(pool, "w1", "w1")  # a new connection, accepted by w1
    await send(pool, "w1", "w1")
    assert [s.reached for s in server.served[2:]] == ["w0", "w1", "w1"]
    assert pool.idle_by_worker() == {"w0": 2, "w1": 1}
    await pool.close()


async def test_no_more_than_max_connections_and_every_waiting_request_is_served(hinting):
    server = await hinting(workers=4, delay=0.02)
    pool = ConnectionPool(server.url, max_connections=2)
    holders = [f"w{k % 4}" for k in range(12)]
    learned = await asyncio.gather(*(send(pool, h, h) for h in holders))
    assert learned == holders
    assert server.most_open == 2 and pool.open_connections == 2
    await pool.close()


async def test_a_broken_connection_leaves_the_pool_and_a_new_one_takes_its_place(hinting):
    server = await hinting(workers=1, close_after={1})
    pool = ConnectionPool(server.url)
    await send(pool, "w0", None)
    with pytest.raises(TransportFailure):
        await send(pool, "w0", "w0")
    assert pool.open_connections == 0
    assert await send(pool, "w0", "w0") == "w0"
    assert pool.open_connections == 1
    await pool.close()
    assert pool.open_connections == 0


async def test_a_closed_pool_refuses_and_a_client_of_another_origin_cannot_use_it(hinting):
    server = await hinting(workers=1)
    pool = ConnectionPool(server.url)
    with pytest.raises(ValueError, match="the pool is for"):
        AsyncHTTPClient("http://127.0.0.1:1", pool=pool)
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionPool(server.url, max_connections=0)
    await pool.close()
    with pytest.raises(TransportFailure, match="closed"):
        await send(pool, "w0", None)


def test_the_pool_runs_on_uvloop_as_an_agent_server_does():
    # uvicorn's workers (the agent's env pools) run on uvloop, whose transports
    # are no asyncio.Transport and whose connection_made comes after the connect.
    import uvloop

    async def main() -> list[str | None]:
        scripted = HintingServer(workers=2)
        server = await scripted.start()
        pool = ConnectionPool(scripted.url)
        try:
            learned = [await send(pool, "w0", None)]
            learned += [await send(pool, holder, holder) for holder in ("w1", "w0", "w1")]
            assert [s.reached for s in scripted.served] == ["w0", "w1", "w0", "w1"]
            assert pool.open_connections == 2
            return learned
        finally:
            await pool.close()
            server.close()

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(main()) == ["w0", "w1", "w0", "w1"]
    finally:
        loop.close()


async def test_a_holder_no_connection_reaches_stops_the_pool_growing_after_a_few_misses(hinting):
    # A session held on another host: connections to this URL never reach its
    # worker. The pool gives up opening connections for it, well below its bound.
    server = await hinting(workers=2)
    pool = ConnectionPool(server.url, max_connections=32)
    for _ in range(30):
        assert await send(pool, "far", "far") == "far"
    assert pool.open_connections <= 8
    assert all(s.reached != "far" for s in server.served)
    await pool.close()


async def test_bytes_after_a_reply_drop_the_connection_and_never_answer_the_next_request(hinting):
    # A server that answers one request with two replies: on a shared connection
    # the second would be read as another session's reply. The pool drops it.
    server = await hinting(workers=1, junk_after={0})
    pool = ConnectionPool(server.url)
    assert await send(pool, "w0", None) == "w0"
    assert pool.open_connections == 0
    assert await send(pool, "w0", "w0") == "w0"  # on a new connection, its own reply
    assert len(server.served) == 2
    await pool.close()


async def test_a_woken_waiter_that_is_cancelled_passes_its_turn_to_the_next(hinting):
    # The race of a release and a cancel, made exact: the connection comes back
    # (waking B) and B is cancelled before it runs; C must get the connection.
    server = await hinting(workers=1)
    pool = ConnectionPool(server.url, max_connections=1, timeout=5)
    connection, _ = await pool._acquire("w0")
    waiting_b = asyncio.create_task(send(pool, "w0", "w0"))
    waiting_c = asyncio.create_task(send(pool, "w0", "w0"))
    await asyncio.sleep(0.05)
    pool._release(connection, None)
    waiting_b.cancel()
    assert await asyncio.wait_for(waiting_c, 2) == "w0"
    with pytest.raises(asyncio.CancelledError):
        await waiting_b
    await pool.close()


async def test_a_holder_given_up_on_still_gets_a_connection_when_none_is_left(hinting):
    server = await hinting(workers=2)
    pool = ConnectionPool(server.url, timeout=2)
    for _ in range(30):  # "far" is missed until the pool stops opening for it
        await send(pool, "far", "far")
    server.close_after.update(range(server.seen, server.seen + pool.open_connections))
    while pool.open_connections:  # the server drops each: the pool has none left
        with pytest.raises(TransportFailure):
            await send(pool, "far", "far")
    assert await asyncio.wait_for(send(pool, "far", "far"), 1) == "far"
    await pool.close()
