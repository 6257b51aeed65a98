"""The framework's own cost of one ``/step``: the worker app against a bare Starlette route.

In-process, no sockets and no HTTP parsing: both apps are called as uvicorn
calls an ASGI app (one ``http.request`` message, ``http.disconnect`` only after
the reply), on the event loop uvicorn's workers run (uvloop when installed).

- ``app``: a one-worker `WorkerApp` serving the counter env (router, cookie
  middleware, Starlette routes, the Gymnasium adapter, metrics recording), with
  the session cookie its ``/reset`` set;
- ``app, metrics off``: the same with ``metrics="off"``;
- ``bare``: a Starlette app with one ``POST /step`` route that parses the JSON
  body and answers a reply of the same shape.

Rounds alternate the three so the shared machine's busy spells spread over all;
the figure is the median of per-round ratios to ``bare``. ``--profile`` prints
where the app's time goes (cProfile, sorted by own time) after the run.

    .venv/bin/python benchmarks/framework_cost.py [--calls 2000] [--rounds 10] [--profile]

This is the in-process part of the issue's "1-worker ``/step`` / bare Starlette
route" figure; over real sockets uvicorn's HTTP handling is added to both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from typing import Any

import _common
from _common import markdown_table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from envs.counter import CounterEnv
from gym_sessions.server import GymEnvServer, WorkerApp
from gym_sessions.settings import Settings
from tests.asgi import ASGIApp, asgi_request

SECRET = "framework-cost-" + "s" * 32
STEP_BODY = b'{"action": 0}'


def bare_app() -> Starlette:
    async def step(request: Request) -> JSONResponse:
        await request.json()
        reply = {"observation": 1, "reward": 0.0, "terminated": False, "truncated": False}
        return JSONResponse({**reply, "info": {}})

    return Starlette(routes=[Route("/step", step, methods=["POST"])])


async def started_app(**settings: Any) -> tuple[WorkerApp, list]:
    """A started one-worker app and the headers of a session it holds."""
    app = WorkerApp(GymEnvServer(CounterEnv), Settings(workers=1, secret=SECRET, **settings))
    await app.startup()
    json_type = (b"content-type", b"application/json")
    reply = await asgi_request(app, "POST", "/reset", b"{}", [json_type])
    assert reply.status == 200, reply.status
    cookie = reply.headers[b"set-cookie"].split(b";", 1)[0]
    return app, [json_type, (b"cookie", cookie)]


async def time_calls(app: ASGIApp, headers: list, calls: int) -> float:
    """Mean microseconds per ``/step`` over ``calls`` calls."""
    begin = time.perf_counter()
    for _ in range(calls):
        await asgi_request(app, "POST", "/step", STEP_BODY, headers)
    return (time.perf_counter() - begin) / calls * 1e6


async def run(calls: int, rounds: int, profile: bool) -> dict[str, Any]:
    app, app_headers = await started_app()
    quiet, quiet_headers = await started_app(metrics="off")
    cases: dict[str, tuple[ASGIApp, list]] = {
        "app": (app, app_headers),
        "app, metrics off": (quiet, quiet_headers),
        "bare": (bare_app(), [(b"content-type", b"application/json")]),
    }
    per_round: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for target, headers in cases.values():  # warm up
            await time_calls(target, headers, 200)
        for _ in range(rounds):
            for name, (target, headers) in cases.items():
                per_round[name].append(await time_calls(target, headers, calls))
        profile_text = None
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await time_calls(app, app_headers, calls)
            profiler.disable()
            stats = pstats.Stats(profiler)
            stats.sort_stats("tottime").print_stats(30)
            profile_text = "printed to stdout"
    finally:
        await app.shutdown()
        await quiet.shutdown()
    bare = per_round["bare"]
    return {
        "calls_per_round": calls,
        "rounds": rounds,
        "mean_us_per_round": per_round,
        "median_ratio_to_bare": {
            name: _common.median_ratio(values, bare) for name, values in per_round.items()
        },
        "profile": profile_text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--profile", action="store_true")
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    loop_factory, loop_name = _common.event_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        measured = runner.run(run(args.calls, args.rounds, args.profile))
    report = {"machine": machine, "loop": loop_name, **measured}
    rows = [
        [
            name,
            f"{_common.percentile(values, 50):.1f}",
            f"{report['median_ratio_to_bare'][name]:.2f}",
        ]
        for name, values in report["mean_us_per_round"].items()
    ]
    print(markdown_table(["case", "us per /step (median round)", "x bare"], rows))
    print("wrote", _common.write_json("framework_cost", report))


if __name__ == "__main__":
    main()
