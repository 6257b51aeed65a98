"""The agent's outbound pool: waiting for a free connection is not a connect failure.

Under load every pooled connection can be busy; a call then waits for one. Only
the TCP connect itself is bounded by ``--upstream-connect-timeout``; the wait is
bounded by the call's total timeout (a bug once counted it as a connect
timeout, and /run answered 502 "cannot reach" for a server that was there).
"""

from __future__ import annotations

import asyncio

from gym_sessions.server.egress import egress_session

POOL = 256  # the agent pool's connection limit


async def test_calls_queued_for_a_pooled_connection_wait_past_the_connect_timeout():
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await asyncio.sleep(1.5)  # every pooled connection busy, longer than a connect may take
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(slow, "127.0.0.1", 0, backlog=1024)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    client = egress_session(
        lambda target: target == url, max_reply_bytes=1024, connect_timeout=0.5, total_timeout=30
    )
    try:

        async def call() -> int:
            async with client.get(url) as reply:
                await reply.read()
                return reply.status

        statuses = await asyncio.gather(*[call() for _ in range(POOL + 20)])
        assert statuses == [200] * (POOL + 20)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()
