"""Where a forwarded request's CPU goes: two in-process workers, a profile of the hop.

A diagnostic beside ``routing_cost.py``. Real `WorkerApp` s of the counter env
share a real runtime directory in one process and one event loop, each with its
real private Unix socket: an owner holding a session, and one front worker per
forward transport the CLI offers. The script calls the ASGI apps directly (no
public TCP listener, no client library) and times:

- local: the owner's app serves a ``/step`` of its own session;
- hop only: the front worker's `Forwarder` sends the step to the owner's
  private socket (served by uvicorn's protocol and the owner's app) and
  streams the reply back, without the front's router;
- forwarded: the front's app gets the step, routes it (cookie, claim file
  read) and forwards it: the whole path of a forwarded request.

Everything runs on one core with no process switch, so the numbers are the
CPU cost of each path; the real-server wall times are in ``routing_cost.py``.
Then cProfile runs the forwarded path and the script prints where its time
goes, by package and by function.

    .venv/bin/python benchmarks/hop_profile.py [--calls 3000]

Prints Markdown tables; writes hop_profile.json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import shutil
import tempfile
import time
import uuid
from collections import defaultdict
from typing import Any

import _common
from _common import markdown_table

from gym_sessions.runtime_dir import RuntimeDirectory
from gym_sessions.server.app import WorkerApp
from gym_sessions.server.targets import load_target
from gym_sessions.settings import Settings

TARGET = "envs.counter:CounterEnv"
LOCAL = "local (owner's app)"


def scope_for(path: str, body: bytes, cookie: str | None) -> dict[str, Any]:
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if cookie:
        headers.append((b"cookie", f"gym_session={cookie}".encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def call(
    app: WorkerApp, path: str, payload: Any, cookie: str | None
) -> tuple[int, Any, list]:
    """One request straight into ``app``; returns status, JSON body and headers."""
    body = json.dumps(payload).encode()
    sent = False
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await app(scope_for(path, body, cookie), receive, send)
    start = messages[0]
    data = b"".join(m.get("body", b"") for m in messages[1:])
    return start["status"], json.loads(data), start["headers"]


def cookie_from(headers: list) -> str:
    for name, value in headers:
        if name == b"set-cookie":
            key, _, rest = value.decode().partition("=")
            if key == "gym_session":
                return rest.split(";", 1)[0]
    raise RuntimeError("no session cookie")


def hop_app(forwarder: Any, owner_id: str) -> Any:
    """An ASGI app that only hands the request to ``owner_id`` with ``forwarder``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        await forwarder.forward(owner_id, scope, body, send)

    return app


async def measure(calls: int, transports: list[str | None]) -> dict[str, Any]:
    base = tempfile.mkdtemp(prefix="gs-hop-", dir="/tmp")
    runtime = RuntimeDirectory.create(base)
    settings = Settings(workers=2, secret="bench-" + "x" * 26, runtime_dir=runtime.path)
    owner = WorkerApp(load_target(TARGET), settings, worker_id="owner")
    fronts = {
        t: WorkerApp(
            load_target(TARGET),
            settings if t is None else settings.replace(forward_transport=t),
            worker_id=f"front-{t or 'default'}",
        )
        for t in transports
    }
    workers = [owner, *fronts.values()]
    try:
        for worker in workers:
            await worker.startup()
        sid = uuid.uuid4().hex
        status, _, headers = await call(owner, "/reset", {"resources_session_id": sid}, None)
        assert status == 200
        cookie = cookie_from(headers)
        count = 0

        async def step(app: Any) -> None:
            nonlocal count
            status, reply, _ = await call(app, "/step", {"action": 1}, cookie)
            count += 1
            assert status == 200 and reply["observation"] == count, (status, reply)

        paths = {LOCAL: owner}
        for t, front in fronts.items():
            name = t or "default"
            paths[f"hop only ({name}): Forwarder.forward -> owner"] = hop_app(
                front.forwarder, owner.worker_id
            )
            paths[f"forwarded ({name}): front app -> owner"] = front
        samples: dict[str, list[float]] = {label: [] for label in paths}
        for _ in range(200):
            for app in paths.values():
                await step(app)
        for _ in range(calls // 50):  # interleaved batches of 50
            for label, app in paths.items():
                for _ in range(50):
                    started = time.perf_counter_ns()
                    await step(app)
                    samples[label].append((time.perf_counter_ns() - started) / 1000)

        profiles = {}
        profiled = [f"forwarded ({transports[0] or 'default'}): front app -> owner", LOCAL]
        for label in profiled:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                await step(paths[label])
            profiler.disable()
            profiles[label] = profiler
        return {"samples": samples, "profiles": profiles, "profiled": profiled}
    finally:
        for worker in workers:
            await worker.shutdown()
        runtime.remove()
        shutil.rmtree(base, ignore_errors=True)


PACKAGES = (
    "aiohttp",
    "yarl",
    "multidict",
    "uvicorn",
    "httptools",
    "starlette",
    "gym_sessions",
    "asyncio",
    "json",
    "itsdangerous",
    "gymnasium",
    "numpy",
    "envs",
)


def package_of(filename: str) -> str:
    if filename.startswith("~") or filename.startswith("<"):
        return "builtins (C)"
    parts = filename.replace("\\", "/").split("/")
    for name in PACKAGES:
        if name in parts:
            return name
    return "other python"


def by_package(profiler: cProfile.Profile, calls: int) -> list[tuple[str, float]]:
    stats = pstats.Stats(profiler)
    totals: dict[str, float] = defaultdict(float)
    for (filename, _, _), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        totals[package_of(filename)] += tottime
    return sorted(((k, 1e6 * v / calls) for k, v in totals.items()), key=lambda kv: -kv[1])


def top_functions(profiler: cProfile.Profile, calls: int, n: int = 15) -> list[tuple[str, float]]:
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        short = "/".join(filename.split("/")[-2:])
        rows.append((f"{short}:{line}({name})", 1e6 * tottime / calls))
    return sorted(rows, key=lambda kv: -kv[1])[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = _common.parse_args(parser)
    print(_common.load_note())
    transports = _common.forward_transports()
    result = asyncio.run(measure(args.calls, transports))
    samples, profiles = result["samples"], result["profiles"]
    stats = {label: _common.summary(values) for label, values in samples.items()}
    print(f"\nIn-process CPU cost per /step, {args.calls} calls per path (us)\n")
    print(
        markdown_table(
            ["path", "p50 us", "p99 us", "mean us"],
            [
                [k, f"{v['p50']:.0f}", f"{v['p99']:.0f}", f"{v['mean']:.0f}"]
                for k, v in stats.items()
            ],
        )
    )
    forwarded_label = result["profiled"][0]
    forwarded, local = profiles[forwarded_label], profiles[LOCAL]
    packages_fwd = by_package(forwarded, args.calls)
    packages_local = dict(by_package(local, args.calls))
    print(
        f"\nProfiled own time per request by package, {forwarded_label} vs local "
        "(us; cProfile inflates absolute numbers)\n"
    )
    print(
        markdown_table(
            ["package", "forwarded", "local", "difference"],
            [
                [
                    name,
                    f"{us:.1f}",
                    f"{packages_local.get(name, 0.0):.1f}",
                    f"{us - packages_local.get(name, 0.0):+.1f}",
                ]
                for name, us in packages_fwd
            ],
        )
    )
    tops = top_functions(forwarded, args.calls)
    print("\nTop functions of the forwarded path by own time (us per request, profiled)\n")
    print(markdown_table(["function", "us"], [[name, f"{us:.1f}"] for name, us in tops]))
    path = _common.write_json(
        "hop_profile",
        {
            "machine": _common.machine(),
            "calls": args.calls,
            "transports": transports,
            "profiled_path": forwarded_label,
            "unit": "microseconds per request, in-process (one loop, no process switch)",
            "timings": stats,
            "profiled_by_package_forwarded": dict(packages_fwd),
            "profiled_by_package_local": packages_local,
            "profiled_top_functions_forwarded": dict(tops),
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
