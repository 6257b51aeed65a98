"""The framework's own cost of one ``/step``: the worker app against a bare Starlette route.

Two modes, both in interleaved rounds (the shared machine's busy spells
spread over every class; figures are medians of per-round ratios to ``bare``):

**In process** (default): no sockets and no HTTP parsing: the apps are called as
uvicorn calls an ASGI app (one ``http.request`` message, ``http.disconnect``
only after the reply), on the event loop uvicorn's workers run (uvloop when
installed).

- ``app``: a one-worker `WorkerApp` serving the counter env (router, cookie
  middleware, Starlette routes, the Gymnasium adapter, metrics recording), with
  the session cookie its ``/reset`` set;
- ``app, metrics off``: the same with ``metrics="off"``;
- ``bare``: `bare_step_app`, a Starlette app with one ``POST /step`` route that
  parses the JSON body and answers a reply of the same shape.

``--profile`` prints where the app's time goes (cProfile, sorted by own time).

**Over HTTP** (``--http``): real ``gym-sessions serve`` processes at 1 worker,
each stepped over one kept-alive connection (``http.client``, TCP_NODELAY),
sequential requests: the counter env, CartPole-v1 and `bare_step_app` served
as an ASGI target, so all three run under the same uvicorn, protocol class
(`BoundedHttpProtocol`, httptools) and loop. Each round times a batch of each
class; per-round p50 ratios to ``bare`` are reported with the servers' CPU
per request (``/proc``). CartPole episodes that end are reset outside the
timed calls.

    .venv/bin/python benchmarks/framework_cost.py [--calls 2000] [--rounds 10] [--profile]
    .venv/bin/python benchmarks/framework_cost.py --http [--rounds 60] [--batch 200] [--against REV]

``--against REV`` adds the counter and CartPole servers of an earlier commit
(its own ``git worktree``, every process checked to import it), so a change's
effect is a ratio from the same rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

import _common
from _common import RawConnection, markdown_table, session_cookie
from bare_step_app import bare_app
from routing_cost import interleaved_rounds

from envs.counter import CounterEnv
from gym_sessions.server import GymEnvServer, WorkerApp
from gym_sessions.server.process import ServerProcess, start_server
from gym_sessions.settings import Settings
from tests.asgi import ASGIApp, asgi_request

SECRET = "framework-cost-" + "s" * 32
STEP_BODY = b'{"action": 0}'


async def started_app(**settings: Any) -> tuple[WorkerApp, list]:
    """A started one-worker app and the headers of a session it holds."""
    app = WorkerApp(GymEnvServer(CounterEnv), Settings(workers=1, secret=SECRET, **settings))
    await app.startup()
    json_type = (b"content-type", b"application/json")
    reply = await asgi_request(app, "POST", "/reset", b"{}", [json_type])
    assert reply.status == 200, reply.status
    cookie = reply.headers[b"set-cookie"].split(b";", 1)[0]
    return app, [json_type, (b"cookie", cookie)]


async def time_calls(app: ASGIApp, headers: list, calls: int) -> tuple[float, float]:
    """Mean microseconds per ``/step`` over ``calls`` calls: wall-clock, and this process's CPU.

    The CPU figure leaves out the time the shared machine ran others instead.
    """
    begin, cpu_begin = time.perf_counter(), time.process_time()
    for _ in range(calls):
        await asgi_request(app, "POST", "/step", STEP_BODY, headers)
    cpu = time.process_time() - cpu_begin
    return (time.perf_counter() - begin) / calls * 1e6, cpu / calls * 1e6


async def run(calls: int, rounds: int, profile: bool) -> dict[str, Any]:
    app, app_headers = await started_app()
    quiet, quiet_headers = await started_app(metrics="off")
    cases: dict[str, tuple[ASGIApp, list]] = {
        "app": (app, app_headers),
        "app, metrics off": (quiet, quiet_headers),
        "bare": (bare_app(), [(b"content-type", b"application/json")]),
    }
    per_round: dict[str, list[float]] = {name: [] for name in cases}
    cpu_per_round: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for target, headers in cases.values():  # warm up
            await time_calls(target, headers, 200)
        for _ in range(rounds):
            for name, (target, headers) in cases.items():
                wall, cpu = await time_calls(target, headers, calls)
                per_round[name].append(wall)
                cpu_per_round[name].append(cpu)
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
        "cpu_us_per_round": cpu_per_round,
        "median_ratio_to_bare": {
            name: _common.median_ratio(values, bare) for name, values in per_round.items()
        },
        "median_cpu_ratio_to_bare": {
            name: _common.median_ratio(values, cpu_per_round["bare"])
            for name, values in cpu_per_round.items()
        },
        "profile": profile_text,
    }


# Over HTTP ---------------------------------------------------------------------------------

#: The servers of ``--http``: class -> (serve target, the body of step ``i``).
HTTP_TARGETS: dict[str, tuple[str, Callable[[int], dict[str, Any]]]] = {
    "counter /step": ("envs.counter:CounterEnv", lambda i: {"action": 1 if i % 2 == 0 else -1}),
    "CartPole-v1 /step": ("CartPole-v1", lambda i: {"action": i % 2}),
    "bare": ("bare_step_app:app", lambda i: {"action": 0}),
}


class SteppedServer:
    """One 1-worker server, one kept-alive connection to it and, for an env, its session."""

    def __init__(self, server: ServerProcess, step_body: Callable[[int], dict[str, Any]]) -> None:
        self.server = server
        self.step_body = step_body
        self.connection = RawConnection(server.url)
        self.headers: dict[str, str] = {}
        #: (server CPU seconds, calls) of each batch, the warm-up's first.
        self.batches: list[tuple[float, int]] = []
        self.session = server.health().get("worker") != "bare"
        if self.session:
            self._reset()

    def _reset(self) -> None:
        status, reply, response = self.connection.request("POST", "/reset", {"seed": 0})
        if status != 200:
            raise RuntimeError(f"reset failed: {status} {reply}")
        cookie = session_cookie(response)
        if cookie is not None:
            self.headers = {"Cookie": f"{_common.COOKIE}={cookie}"}

    def steps(self, r: int, n: int, into: list[float]) -> None:
        """``n`` sequential steps; appends each one's seconds to ``into`` (resets are not timed)."""
        cpu_before = _common.tree_cpu_seconds(self.server.process.pid)
        for i in range(n):
            body = self.step_body(i)
            begin = time.perf_counter()
            status, reply, _ = self.connection.request("POST", "/step", body, self.headers)
            into.append(time.perf_counter() - begin)
            if status != 200:
                raise RuntimeError(f"step failed: {status} {reply}")
            if reply["terminated"] or reply["truncated"]:
                self._reset()
        self.batches.append((_common.tree_cpu_seconds(self.server.process.pid) - cpu_before, n))

    def cpu_us_per_call(self) -> float:
        """Server CPU per call over the timed batches (the warm-up left out)."""
        timed = self.batches[1:]
        return sum(cpu for cpu, _ in timed) / max(sum(n for _, n in timed), 1) * 1e6


def run_http(rounds: int, batch: int, warmup: int, against: str | None) -> dict[str, Any]:
    """Interleaved rounds of sequential ``/step`` against the 1-worker servers.

    With ``against``, the counter and CartPole servers of that commit too,
    each served from its own worktree (`_common.start_revision_server`).
    """
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    imported: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stepped = {}
        for name, (target, body) in HTTP_TARGETS.items():
            server = stack.enter_context(start_server(target, env={"PYTHONPATH": path}))
            stepped[name] = SteppedServer(server, body)
            stack.callback(stepped[name].connection.close)
        if against is not None:
            (revision,) = stack.enter_context(_common.worktrees([against]))
            for name, (target, body) in HTTP_TARGETS.items():
                if name == "bare":
                    continue
                server = _common.start_revision_server(revision, target, workers=1)
                stack.callback(server.stop)
                label = f"{name} at {against}"
                imported[label] = {"commit": revision.commit, "imported": server.imported}
                stepped[label] = SteppedServer(server, body)
                stack.callback(stepped[label].connection.close)
        batches = {name: s.steps for name, s in stepped.items()}
        per_round = interleaved_rounds(batches, cycle=1, warmup=warmup, rounds=rounds, batch=batch)
        cpu_us = {name: s.cpu_us_per_call() for name, s in stepped.items()}
    p50s = {name: [_common.percentile(b, 50) * 1e3 for b in per_round[name]] for name in batches}
    pooled = {
        name: _common.summary([x * 1e3 for b in per_round[name] for x in b]) for name in batches
    }
    return {
        "rounds": rounds,
        "batch": batch,
        "warmup": warmup,
        "against": imported,
        "pooled_ms": pooled,
        "round_p50_ms": p50s,
        "server_cpu_us_per_call": cpu_us,
        "median_p50_ratio_to_bare": {
            name: _common.median_ratio(p50s[name], p50s["bare"]) for name in batches
        },
        "median_p50_ratio_to_against": {
            name: _common.median_ratio(p50s[name], p50s[f"{name} at {against}"])
            for name in HTTP_TARGETS
            if f"{name} at {against}" in p50s
        },
    }


def print_http(report: dict[str, Any]) -> None:
    rows = [
        [
            name,
            f"{pooled['p50']:.3f}",
            f"{pooled['p90']:.3f}",
            f"{pooled['p99']:.3f}",
            f"{report['median_p50_ratio_to_bare'][name]:.3f}",
            f"{report['server_cpu_us_per_call'][name]:.0f}",
        ]
        for name, pooled in report["pooled_ms"].items()
    ]
    headers = ["class", "p50 ms", "p90 ms", "p99 ms", "p50 / bare", "server CPU us/call"]
    print(markdown_table(headers, rows))
    for name, ratio in report["median_p50_ratio_to_against"].items():
        print(f"{name}: this tree / the other commit, median of per-round p50 ratios: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="in process: calls per round")
    parser.add_argument("--rounds", type=int, default=None, help="default 10 (in process), 60")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--http", action="store_true", help="real 1-worker servers over HTTP")
    parser.add_argument("--batch", type=int, default=200, help="--http: steps per class per round")
    parser.add_argument("--warmup", type=int, default=300, help="--http: unrecorded steps")
    parser.add_argument(
        "--against", metavar="REV", help="--http: also the counter and CartPole servers of REV"
    )
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    if args.http:
        measured = run_http(args.rounds or 60, args.batch, args.warmup, args.against)
        report = {"machine": machine, "mode": "http", **measured}
        print_http(report)
        print(_common.load_note())
        print("wrote", _common.write_json("framework_cost_http", report))
        return
    args.rounds = args.rounds or 10
    loop_factory, loop_name = _common.event_loop_factory()
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        measured = runner.run(run(args.calls, args.rounds, args.profile))
    report = {"machine": machine, "loop": loop_name, **measured}
    rows = [
        [
            name,
            f"{_common.percentile(values, 50):.1f}",
            f"{report['median_ratio_to_bare'][name]:.2f}",
            f"{_common.percentile(report['cpu_us_per_round'][name], 50):.1f}",
            f"{report['median_cpu_ratio_to_bare'][name]:.2f}",
        ]
        for name, values in report["mean_us_per_round"].items()
    ]
    headers = ["case", "us per /step (median round)", "x bare", "CPU us per /step", "CPU x bare"]
    print(markdown_table(headers, rows))
    print("wrote", _common.write_json("framework_cost", report))


if __name__ == "__main__":
    main()
