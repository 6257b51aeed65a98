"""A resources server whose ``wait`` tool awaits: for handlers cancelled by a disconnect.

Each session keeps a tally of its ``wait`` calls: how many started, finished
and were cancelled (the router cancels a cancellable handler whose client
disconnected before its reply), and how many times its start hook was entered
(a start body's ``options.start_seconds`` makes the hook await that long).
``tally`` reads it without waiting.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request

from gym_sessions.server.bodies import BodySchema, Field
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool

WAIT_BODY = BodySchema({"seconds": Field(("number",), required=True)})


class SlowToolServer(ResourcesServer):
    def __init__(self) -> None:
        self.tallies: dict[str, dict[str, int]] = {}
        self.start_calls: dict[str, int] = {}

    def tools(self) -> list[Tool]:
        return [
            Tool("wait", "Wait `seconds`, then return the tally.", WAIT_BODY, self._wait),
            Tool("tally", "The session's tally of wait calls.", BodySchema(), self._tally),
        ]

    async def start_session(self, session_id: str, body: dict[str, Any], path: str) -> dict:
        calls = self.start_calls[session_id] = self.start_calls.get(session_id, 0) + 1
        await asyncio.sleep(float((body.get("options") or {}).get("start_seconds", 0)))
        self.tallies[session_id] = {"started": 0, "finished": 0, "cancelled": 0, "starts": calls}
        return {}

    async def _wait(self, request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
        tally = self.tallies[session_id(request)]
        tally["started"] += 1
        try:
            await asyncio.sleep(arguments["seconds"])
        except asyncio.CancelledError:
            tally["cancelled"] += 1
            raise
        tally["finished"] += 1
        return dict(tally)

    async def _tally(self, request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
        return dict(self.tallies[session_id(request)])

    def release_session(self, session_id: str) -> None:
        self.tallies.pop(session_id, None)
        self.start_calls.pop(session_id, None)
