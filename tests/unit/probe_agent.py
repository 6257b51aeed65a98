"""An agent server for routing tests whose hooks the test controls."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from gym_sessions.server.agent import AgentServer


class ProbeAgent(AgentServer):
    """Agent sessions hold ``{"n": int}``; ``/bump`` increments it.

    Seed body flags: ``nothing`` (the seed creates nothing), ``refuse`` (the
    state cannot be registered), ``close_fails`` (the close hook raises while
    ``close_failures`` is positive).
    """

    def __init__(self) -> None:
        super().__init__()
        self.closed_states: list[str] = []
        self.close_failures = 0
        self.seed_delay = 0.0
        self.seeded: list[str] = []

    @property
    def worker(self) -> str:
        return self.claims.worker_id

    async def seed_agent_session(self, sid: str, body: dict[str, Any]) -> Any:
        if body.get("nothing"):
            return None
        if self.seed_delay:
            await asyncio.sleep(self.seed_delay)  # a hook that awaits, as real ones do
        self.seeded.append(sid)
        return {"n": 0, "refuse": body.get("refuse", False), "close_fails": body.get("close_fails")}

    def register_agent_session(self, sid: str, state: Any) -> None:
        if state["refuse"]:
            raise RuntimeError("refused")
        super().register_agent_session(sid, state)

    async def close_agent_session(self, sid: str, state: Any) -> dict[str, Any]:
        if state.get("close_fails") and self.close_failures > 0:
            self.close_failures -= 1
            raise RuntimeError("close hook failed")
        self.closed_states.append(sid)
        return {"n": state["n"], "worker": self.worker}

    def extra_routes(self) -> list[BaseRoute]:
        return [Route("/bump", self.bump, methods=["POST"])]

    async def bump(self, request: Request) -> JSONResponse:
        state = self.agent_state(request)
        if state is None:
            return JSONResponse({"worker": self.worker, "n": None})
        state["n"] += 1
        return JSONResponse({"worker": self.worker, "n": state["n"]})
