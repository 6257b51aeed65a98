"""Where a burst of session starts lands: sessions per worker by ``--placement``.

A burst of untyped ``POST /reset`` (no id: the server mints one), all at once,
against a fresh 4-worker counter server with ``--debug-worker-header``: each
reply names the worker that holds the new session (``x-gym-worker``); a
``GET /health`` first on the same connection names the worker that accepted
it, so a start placed on another worker shows. Configurations, all from this
checkout: ``--placement local`` (the session starts where uvicorn's shared
socket handed the connection), ``--placement balanced`` (the default: it
starts on the worker with the fewest sessions), and balanced with
``--max-sessions 100`` (the burst is 4 x 100, so every worker must end with
exactly 100). Clients:

- ``new``: every start on a new connection, ``--in-flight`` connections open
  at once (all 400, or 64: the size of the aiohttp pools in the tests and the demo);
- ``pooled``: ``--in-flight`` kept-alive connections opened up front, each
  sending its share of the starts one after another (a client pool).

Each configuration runs ``--repeat`` times (a fresh server each time),
interleaved. ``/health`` on every worker must agree with the replies. The
figure of merit is max/min of the sessions per worker.

    .venv/bin/python benchmarks/placement.py [--starts 400] [--repeat 3] [--in-flight 400 64]
        [--clients new pooled] [--hog]

With ``--hog`` the bursts run while one busy loop per core competes for the
CPU (tests/stress/hog.py): a loaded machine is where the kernel's hand-out of
connections is most uneven.

Prints a Markdown table; writes placement[_hog].json
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
from collections import Counter
from typing import Any

import _common
import aiohttp
from _common import markdown_table

from gym_sessions.server.process import start_server
from tests.stress.hog import cpu_hog

TARGET = "envs.counter:CounterEnv"
WORKERS = 4


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, dict[str, str], Any]:
    """One HTTP/1.1 request and its reply (with a ``content-length``) on an open connection."""
    writer.write(request)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(head[0].split()[1]), headers, json.loads(body) if body else None


def _requests() -> tuple[bytes, bytes]:
    reset = json.dumps({"options": {"initial_count": 0}}).encode()
    health_request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    reset_request = (
        b"POST /reset HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(reset), reset)
    )
    return health_request, reset_request


def _placed(status: int, headers: dict[str, str], data: Any, accepted_by: str) -> dict[str, Any]:
    return {
        "status": status,
        "code": ((data or {}).get("error") or {}).get("code"),
        "worker": headers.get("x-gym-worker"),
        "accepted_by": accepted_by,
    }


async def burst(url: str, starts: int, in_flight: int) -> list[dict[str, Any]]:
    """``starts`` untyped resets, each on its own new connection, ``in_flight`` at a time.

    Each connection first asks ``GET /health`` (never forwarded: it names the
    worker that accepted the connection), then sends the reset; the reply's
    ``x-gym-worker`` names the worker that holds the new session.
    """
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    health_request, reset_request = _requests()
    gate = asyncio.Semaphore(in_flight)

    async def start() -> dict[str, Any]:
        async with gate:
            return await one()

    async def one() -> dict[str, Any]:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            return {"status": None, "code": type(exc).__name__}
        try:
            async with asyncio.timeout(120):
                _, _, health = await _exchange(reader, writer, health_request)
                status, headers, data = await _exchange(reader, writer, reset_request)
            return _placed(status, headers, data, health["worker"])
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            return {"status": None, "code": type(exc).__name__}
        finally:
            writer.close()

    return await asyncio.gather(*[start() for _ in range(starts)])


async def pooled_burst(url: str, starts: int, connections: int) -> list[dict[str, Any]]:
    """``starts`` untyped resets over ``connections`` kept-alive connections opened up front.

    Each connection asks ``GET /health`` once (the worker that accepted it),
    then sends its share of the resets one after another, as a client pool does.
    """
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    health_request, reset_request = _requests()
    shares = [
        starts // connections + (1 if i < starts % connections else 0) for i in range(connections)
    ]

    async def client(share: int) -> list[dict[str, Any]]:
        try:
            reader, writer = await asyncio.open_connection(host, int(port))
        except OSError as exc:
            return [{"status": None, "code": type(exc).__name__}] * share
        results: list[dict[str, Any]] = []
        try:
            async with asyncio.timeout(120):
                _, _, health = await _exchange(reader, writer, health_request)
                for _ in range(share):
                    status, headers, data = await _exchange(reader, writer, reset_request)
                    results.append(_placed(status, headers, data, health["worker"]))
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
            results += [{"status": None, "code": type(exc).__name__}] * (share - len(results))
        finally:
            writer.close()
        return results

    per_client = await asyncio.gather(*[client(n) for n in shares if n])
    return [r for results in per_client for r in results]


async def open_sessions_by_worker(url: str, within: float = 15.0) -> dict[str, int]:
    """Live sessions per worker from ``/health``, probed on new connections until all 4 answer."""
    seen: dict[str, int] = {}
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as client:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within

        async def probe() -> dict:
            async with client.get(url + "/health") as reply:
                return await reply.json()

        while len(seen) < WORKERS and loop.time() < deadline:
            for health in await asyncio.gather(*[probe() for _ in range(16)]):
                seen[health["worker"]] = health.get("open_sessions", health["sessions"])
    return seen


def run_once(args: tuple[str, ...], starts: int, in_flight: int, clients: str) -> dict[str, Any]:
    with start_server(TARGET, "--debug-worker-header", *args, workers=WORKERS) as server:
        make_burst = pooled_burst if clients == "pooled" else burst
        replies = asyncio.run(make_burst(server.url, starts, in_flight))
        healths = asyncio.run(open_sessions_by_worker(server.url))
    placed = Counter(r["worker"] for r in replies if r["status"] == 200)
    accepted = Counter(r["accepted_by"] for r in replies if r.get("accepted_by"))
    workers = sorted(set(healths) | set(placed) | set(accepted))
    per_worker = {w: placed.get(w, 0) for w in workers}
    counts = list(per_worker.values()) + [0] * (WORKERS - len(per_worker))
    return {
        "statuses": dict(Counter(str(r["status"]) for r in replies)),
        "error_codes": dict(Counter(r["code"] for r in replies if r["code"])),
        "handed_to_another_worker": sum(
            1 for r in replies if r["status"] == 200 and r["accepted_by"] != r["worker"]
        ),
        "sessions_per_worker": per_worker,
        "max_over_min": max(counts) / min(counts) if min(counts) else float("inf"),
        "accepted_per_worker": {w: accepted.get(w, 0) for w in workers},
        "health_open_sessions": healths,
        "health_agrees": all(healths.get(w, 0) == placed.get(w, 0) for w in workers)
        and len(healths) == WORKERS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=400)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=int, default=100, help="--max-sessions of the capped run")
    parser.add_argument(
        "--hog", action="store_true", help="while one busy loop per core competes for the CPU"
    )
    parser.add_argument(
        "--in-flight",
        type=int,
        nargs="+",
        default=[400, 64],
        help="connections open at once (64: like an aiohttp pool of the tests' default size)",
    )
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=("new", "pooled"),
        default=["new", "pooled"],
        help="a new connection per start, or kept-alive connections each sending many",
    )
    args = _common.parse_args(parser)
    print(_common.load_note())
    machine = _common.machine()
    hog = cpu_hog() if args.hog else contextlib.nullcontext()
    configurations = [
        ("--placement local", ("--placement", "local")),
        ("--placement balanced", ("--placement", "balanced")),
        (
            f"--placement balanced --max-sessions {args.limit}",
            ("--placement", "balanced", "--max-sessions", str(args.limit)),
        ),
    ]
    loads = [(c, n) for c in args.clients for n in args.in_flight]
    names = [
        f"{name}; {c} connections, {n} at a time" for c, n in loads for name, _ in configurations
    ]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with hog:
        for _ in range(args.repeat):
            for clients, n in loads:
                for name, extra in configurations:
                    result = run_once(extra, args.starts, n, clients)
                    key = f"{name}; {clients} connections, {n} at a time"
                    runs[key].append(result)
                    placed = sorted(result["sessions_per_worker"].values())
                    print(f"{key}: {placed} max/min {result['max_over_min']:.2f}", flush=True)
    report = {
        "machine": machine,
        "cpu_hog": f"{os.cpu_count()} busy loops (tests/stress/hog.py)" if args.hog else None,
        "starts": args.starts,
        "workers": WORKERS,
        "commit": _common._git("rev-parse", "HEAD"),
        "runs": runs,
    }
    print()
    print(table(report))
    path = _common.write_json("placement_hog" if args.hog else "placement", report)
    print(f"\nwrote {path}")


def table(report: dict) -> str:
    rows = []
    for name, runs in report["runs"].items():
        for index, run in enumerate(runs):
            statuses = ", ".join(f"{n} x {s}" for s, n in sorted(run["statuses"].items()))
            rows.append(
                [
                    name if index == 0 else "",
                    str(sorted(run["sessions_per_worker"].values())),
                    f"{run['max_over_min']:.2f}",
                    str(sorted(run["accepted_per_worker"].values())),
                    run["handed_to_another_worker"],
                    statuses,
                    "yes" if run["health_agrees"] else "NO",
                ]
            )
    headers = [
        "server",
        "sessions per worker (sorted)",
        "max/min",
        "connections accepted per worker",
        "starts handed to another worker",
        "replies",
        "/health agrees",
    ]
    return markdown_table(headers, rows)


if __name__ == "__main__":
    main()
