"""``/ws`` messages on an in-process cluster: each one routed as its HTTP request (§3.16).

A WebSocket is driven into a chosen worker's real `WorkerApp` as uvicorn would
hand it (the cluster's own listeners speak HTTP only); its messages' requests
go through that worker's router, hops over the real private sockets included.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from .cluster import Worker, new_id, seed_start


class Socket:
    """One WebSocket accepted by ``worker``'s app."""

    def __init__(self, worker: Worker, cookie: str | None = None) -> None:
        headers = [(b"host", b"test")]
        if cookie is not None:
            headers.append((b"cookie", f"gym_session={cookie}".encode()))
        scope = {"type": "websocket", "path": "/ws", "headers": headers, "subprotocols": []}
        self.incoming: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.outgoing: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.incoming.put_nowait({"type": "websocket.connect"})
        self.task = asyncio.create_task(worker.app(scope, self.incoming.get, self.outgoing.put))
        self.next_id = 0

    async def open(self) -> Socket:
        assert (await self._sent())["type"] == "websocket.accept"
        return self

    async def request(self, path: str, body: Any = None, **fields: Any) -> dict[str, Any]:
        self.next_id += 1
        envelope = {"id": self.next_id, "path": path, "body": body, **fields}
        self.incoming.put_nowait({"type": "websocket.receive", "text": json.dumps(envelope)})
        message = await self._sent()
        assert message["type"] == "websocket.send", message
        return dict(json.loads(message["text"]))

    async def _sent(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.outgoing.get(), 10)

    async def leave(self) -> None:
        self.incoming.put_nowait({"type": "websocket.disconnect", "code": 1000})
        await asyncio.wait_for(self.task, 10)


def cookie_of(reply: dict[str, Any]) -> str:
    for name, value in reply["headers"]:
        if name == "set-cookie":
            return str(value).split(";", 1)[0].split("=", 1)[1]
    raise AssertionError(f"no cookie in {reply}")


async def test_starts_over_a_websocket_stay_on_its_worker_and_other_sockets_reach_them(cluster):
    c = await cluster(4, placement="balanced")
    socket = await Socket(c[0]).open()
    starts = []
    for _ in range(8):
        reply = await socket.request(
            "/seed_session", {"resources_session_id": new_id()}, new_session=True
        )
        assert reply["status"] == 200, reply
        starts.append(reply)
    # Balanced placement would spread HTTP starts; a WebSocket's start where it is.
    assert {reply["body"]["worker"] for reply in starts} == {c[0].id}
    await socket.leave()
    http = [await seed_start(c[0]) for _ in range(8)]
    assert len({reply.json["worker"] for reply in http}) > 1

    # Each session's messages on a socket of every other worker reach its holder, in order.
    for round_, reply in enumerate(starts):
        other = await Socket(c[1 + round_ % 3], cookie_of(reply)).open()
        for count in (1, 2, 3):
            touched = await other.request("/touch", {})
            assert touched["status"] == 200, touched
            assert touched["body"] == {
                "worker": c[0].id,
                "sid": reply["body"]["resources_session_id"],
                "count": count,
            }
        await other.leave()
    # Every message went to the holder over the hop (a message's request has no
    # connection to hand over).
    assert sum(worker.app.router.deliveries.hopped for worker in c.workers[1:]) >= 24


async def test_a_websocket_without_the_cookie_reaches_no_session(cluster):
    c = await cluster(2)
    started = await seed_start(c[0])
    assert started.status == 200
    stranger = await Socket(c[1]).open()
    touched = await stranger.request("/touch", {})
    # A minted id of its own: never the other session's state.
    assert touched["status"] == 200
    assert touched["body"]["sid"] != started.json["resources_session_id"]
    assert touched["body"]["count"] == 1
    await stranger.leave()
