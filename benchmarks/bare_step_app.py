"""The baseline of `framework_cost.py`: a bare Starlette app with a ``POST /step`` JSON route.

It parses the JSON body and answers a reply of the counter's ``/step`` shape,
with no sessions, cookies, routing or metrics. ``GET /health`` lets
``start_server`` see it ready. Served over HTTP as any ASGI target is
(``gym-sessions serve bare_step_app:app`` with this folder on ``PYTHONPATH``),
so it runs under the same uvicorn, protocol class and event loop as the
worker app it is compared with.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

__all__ = ["app", "bare_app"]


async def _step(request: Request) -> JSONResponse:
    await request.json()
    reply = {"observation": 1, "reward": 0.0, "terminated": False, "truncated": False}
    return JSONResponse({**reply, "info": {}})


async def _health(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok", "worker": "bare"})


def bare_app() -> Starlette:
    """A new bare app."""
    return Starlette(routes=[Route("/step", _step, methods=["POST"]), Route("/health", _health)])


app = bare_app()
