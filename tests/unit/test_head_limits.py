"""The router's own head check (a head over ``max_header_bytes`` that arrived in one read).

`BoundedHttpProtocol` refuses a head as it crosses its limit; a head that came
in whole, under the protocol's bound but over the router's, is refused by the
router, and its connection closes just the same rather than staying kept-alive.
"""

from __future__ import annotations

import asyncio

from .probe_server import ProbeServer


async def test_a_431_from_the_router_closes_the_connection(start_clusters):
    c = await start_clusters(ProbeServer, 1, max_header_bytes=4096)
    reader, writer = await asyncio.open_unix_connection(c[0].public_path)
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 5000 + b"\r\n\r\n")
        # Everything up to the server's close; a kept-alive connection would never end.
        reply = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert b'"code": "headers_too_large"' in reply
    assert b"connection: close" in reply.lower()


async def test_a_head_under_the_limit_keeps_its_connection(start_clusters):
    c = await start_clusters(ProbeServer, 1, max_header_bytes=4096)
    reader, writer = await asyncio.open_unix_connection(c[0].public_path)
    try:
        for _ in range(2):  # two requests on one connection
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 3000 + b"\r\n\r\n")
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 200 "), status
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                name, _, value = line.decode().partition(":")
                if name.lower() == "content-length":
                    length = int(value)
            await reader.readexactly(length)
    finally:
        writer.close()
