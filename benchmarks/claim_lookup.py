"""Cost of a claim lookup and a session-start claim: own (memory), file store, Redis store.

In-process, no server. Two workers, "w1" and "w2", share

- a `FileClaimStore` directory in a temporary directory under /tmp (the
  filesystem of a real server's runtime directory), and
- a real ``redis-server`` on loopback (``tests.services.run_redis``)
  through `RedisClaimStore`, each worker with its own client from
  `connect_redis` (the product's pool, timeouts and retry), both workers
  registered in Redis as a live server's workers are;

worker "w1" owns half of the sessions, worker "w2" the other half, and ``w1``
times, awaiting each coroutine on the event loop uvicorn's workers run (uvloop
when installed):

- `OwnedClaims.holder` for its own claims (the dict lookup every local request does),
- `OwnedClaims.holder` for another worker's claims, file store (open, read, close)
  and Redis store (`RedisClaimStore.read`: one script round trip), which every
  forwarded request does on the accepting worker; also `RedisClaimStore.read`
  called directly,
- `OwnedClaims.holder` for unclaimed ids (no file / no key),

plus `create` (a session start's claim) on each store, and a few parts (the
claim's sha256 name, a file read by hand, a Redis PING on the same client and
over a bare asyncio stream, the round trip's floor without redis-py).
Each call is timed on its own with ``time.perf_counter_ns`` around the
``await`` (the timer's own cost is measured and shown, not subtracted), and
also in batches of 100 calls (mean per call). The cases alternate in
``--rounds`` interleaved rounds, each timing a slice of every case's calls, so
the shared machine's busy spells spread over all of them.

    .venv/bin/python benchmarks/claim_lookup.py [--calls 20000] [--claims 2000] [--rounds 10]

Needs ``redis-server`` (``apt-get install -y redis-server``); exits 2 without it.
Prints a Markdown table; writes claim_lookup.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import _common
from _common import markdown_table

from gym_sessions.routing.claim_store import FileClaimStore
from gym_sessions.routing.keys import claim_name
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.routing.redis_connection import connect_redis
from gym_sessions.routing.redis_registry import EntrySigner, WorkerRegistry
from tests.services import RedisProcess, run_redis

BATCH = 100
WINDOW = 300.0

TIMER = "timer only (perf_counter_ns pair)"
OWN = "owner(): own claim (memory)"
OTHER_FILE = "owner(): other worker's claim, file store"
OTHER_REDIS = "owner(): other worker's claim, Redis store"
READ_REDIS = "RedisClaimStore.read: other worker's claim"
UNCLAIMED_FILE = "owner(): unclaimed id, file store (no file)"
UNCLAIMED_REDIS = "owner(): unclaimed id, Redis store (no key)"
CREATE_FILE = "FileClaimStore.create (session start)"
CREATE_REDIS = "RedisClaimStore.create (session start)"

Call = Callable[[str], Awaitable[object]]


async def timed_each(call: Call, ids: list[str]) -> list[float]:
    """Nanoseconds of each ``await call(id)``."""
    clock = time.perf_counter_ns
    samples = []
    for sid in ids:
        started = clock()
        await call(sid)
        samples.append(clock() - started)
    return samples


async def timed_batches(call: Call, ids: list[str]) -> list[float]:
    """Mean nanoseconds per ``await call(id)`` over consecutive batches of ``BATCH`` calls."""
    clock = time.perf_counter_ns
    samples = []
    for start in range(0, len(ids) - BATCH + 1, BATCH):
        chunk = ids[start : start + BATCH]
        started = clock()
        for sid in chunk:
            await call(sid)
        samples.append((clock() - started) / BATCH)
    return samples


def awaitable(function: Callable[[str], object]) -> Call:
    """A coroutine function around a plain one (for the reference rows)."""

    async def call(sid: str) -> object:
        return function(sid)

    return call


def read_buffered(path: str) -> bytes:
    with open(path, "rb") as file:
        return file.read()


def read_raw(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 256)
    finally:
        os.close(fd)


def redis_store(url: str, worker: str) -> RedisClaimStore:
    """Worker ``worker``'s Redis store, as `WorkerApp` builds it."""
    registry = WorkerRegistry(connect_redis(url), worker, EntrySigner("bench-" + "x" * 32))
    return RedisClaimStore(registry.client, registry, WINDOW + 10.0)


async def register_forever(store: RedisClaimStore, port: int) -> None:
    """Register the store's worker, without the expiry a heartbeat would keep renewing.

    A run is longer than a registration lives; without it every read of this
    worker's claims would take the orphaned-claim path.
    """
    await store.registry.register("127.0.0.1", port)
    await store.client.persist(store.registry.key_prefix + store.worker_id)


async def measure(args: argparse.Namespace, claims_dir: str, redis_url: str) -> dict[str, Any]:
    rng = random.Random(0)

    def draw(pool: list[str]) -> list[str]:
        return [rng.choice(pool) for _ in range(args.calls)]

    def new_ids() -> list[str]:
        return [uuid.uuid4().hex for _ in range(args.calls)]

    def paths(pool: list[str]) -> list[str]:
        return [os.path.join(claims_dir, claim_name(sid)) for sid in draw(pool)]

    mine = OwnedClaims(FileClaimStore(claims_dir, "w1"), "w1", window=WINDOW)
    theirs = OwnedClaims(FileClaimStore(claims_dir, "w2"), "w2", window=WINDOW)
    redis_mine_store = redis_store(redis_url, "w1")
    redis_theirs_store = redis_store(redis_url, "w2")
    redis_creator = redis_store(redis_url, "w3")
    stores = [redis_mine_store, redis_theirs_store, redis_creator]
    writers: list[asyncio.StreamWriter] = []
    try:
        for fake_port, store in enumerate(stores, start=40001):  # never connected to
            await register_forever(store, fake_port)
        redis_mine = OwnedClaims(redis_mine_store, "w1", window=WINDOW)
        redis_theirs = OwnedClaims(redis_theirs_store, "w2", window=WINDOW)
        own_ids = [uuid.uuid4().hex for _ in range(args.claims)]
        other_ids = [uuid.uuid4().hex for _ in range(args.claims)]
        for sid in own_ids:
            assert await mine.claim(sid) is None
            assert await redis_mine.claim(sid) is None
        for sid in other_ids:
            assert await theirs.claim(sid) is None
            assert await redis_theirs.claim(sid) is None
        for claims in (mine, redis_mine):
            assert await claims.holder(own_ids[0]) == "w1"
            assert await claims.holder(other_ids[0]) == "w2"
            assert await claims.holder(uuid.uuid4().hex) is None

        file_creator = FileClaimStore(claims_dir, "w3")
        client = redis_mine_store.client

        async def empty(sid: str) -> None:
            return None

        async def ping(sid: str) -> object:
            return await client.ping()

        # The floor under any client library: PING over a bare asyncio stream.
        redis_host, redis_port = redis_url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)
        reader, writer = await asyncio.open_connection(redis_host, int(redis_port))
        writers.append(writer)

        async def bare_ping(sid: str) -> bytes:
            writer.write(b"PING\r\n")
            return await reader.readline()

        # label -> (call, ids timed one by one, ids timed in batches; [] = no batches)
        cases: dict[str, tuple[Call, list[str], list[str]]] = {
            TIMER: (empty, [], []),  # timed without a call, below
            "await of an empty coroutine": (empty, draw(own_ids), draw(own_ids)),
            OWN: (mine.owner, draw(own_ids), draw(own_ids)),
            OTHER_FILE: (mine.owner, draw(other_ids), draw(other_ids)),
            OTHER_REDIS: (redis_mine.owner, draw(other_ids), draw(other_ids)),
            READ_REDIS: (redis_mine_store.read, draw(other_ids), draw(other_ids)),
            UNCLAIMED_FILE: (mine.owner, new_ids(), new_ids()),
            UNCLAIMED_REDIS: (redis_mine.owner, new_ids(), new_ids()),
            CREATE_FILE: (file_creator.create, new_ids(), []),
            CREATE_REDIS: (redis_creator.create, new_ids(), []),
            # Where the time goes (not product code: the same steps, by hand).
            "part: claim_name (sha256 hex)": (awaitable(claim_name), draw(other_ids), []),
            "part: open()+read() of a claim path (buffered)": (
                awaitable(read_buffered),
                paths(other_ids),
                [],
            ),
            "part: os.open+os.read+os.close of a claim path (read_now's way)": (
                awaitable(read_raw),
                paths(other_ids),
                [],
            ),
            "part: Redis PING on the same client (one round trip)": (ping, draw(own_ids), []),
            "part: Redis PING over a bare asyncio stream (no redis-py)": (
                bare_ping,
                draw(own_ids),
                [],
            ),
        }
        # Warm caches first; create() cannot repeat an id, so it gets no warm-up.
        for label, (call, each_ids, _) in cases.items():
            if "create" not in label:
                for sid in each_ids[:500]:
                    await call(sid)
        # The cases alternate in rounds (order rotating), so a busy spell of the
        # shared machine hits them all alike; each round times a slice of each
        # case's ids.
        labels = list(cases)
        each_ns: dict[str, list[float]] = {label: [] for label in labels}
        batch_ns: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.rounds):
            shift = r % len(labels)
            for label in labels[shift:] + labels[:shift]:
                call, each_ids, batch_ids = cases[label]
                if label == TIMER:
                    each_ns[label] += timer_only(args.calls // args.rounds)
                    continue
                each_ns[label] += await timed_each(call, round_slice(each_ids, r, args.rounds))
                batch_ns[label] += await timed_batches(call, round_slice(batch_ids, r, args.rounds))
        results: dict[str, dict[str, Any]] = {}
        for label in labels:
            each = [ns / 1000 for ns in each_ns[label]]
            batched = [ns / 1000 for ns in batch_ns[label]]
            results[label] = {
                "each_us": _common.summary(each),
                "batched_mean_us": _common.summary(batched) if batched else None,
            }
        # The last timed create of each store made its claim.
        last = args.rounds - 1
        assert (
            await file_creator.read(round_slice(cases[CREATE_FILE][1], last, args.rounds)[-1])
            == "w3"
        )
        assert (
            await redis_creator.read(round_slice(cases[CREATE_REDIS][1], last, args.rounds)[-1])
            == "w3"
        )
        return results
    finally:
        for writer in writers:
            writer.close()
        for store in stores:
            await store.close()


def timer_only(calls: int) -> list[float]:
    """Nanoseconds between two back-to-back ``perf_counter_ns`` calls."""
    clock = time.perf_counter_ns
    samples = []
    for _ in range(calls):
        started = clock()
        samples.append(clock() - started)
    return samples


def round_slice(ids: list[str], r: int, rounds: int) -> list[str]:
    """Round ``r``'s share of ``ids``."""
    size = len(ids) // rounds
    return ids[r * size : (r + 1) * size]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="timed calls per case")
    parser.add_argument("--claims", type=int, default=2000, help="claims each worker holds")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds")
    args = _common.parse_args(parser)
    _common.needs("redis-server", "redis-server", "claim_lookup")
    print(_common.load_note())
    machine = _common.machine()  # before the run: its load average is the one at the start
    loop_factory, loop_name = _common.event_loop_factory()

    base = tempfile.mkdtemp(prefix="gs-claims-", dir="/tmp")
    try:
        claims_dir = os.path.join(base, "claims")
        os.mkdir(claims_dir, 0o700)
        with run_redis() as redis_server, asyncio.Runner(loop_factory=loop_factory) as runner:
            redis_version = server_version(redis_server)
            cases = runner.run(measure(args, claims_dir, redis_server.url))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print(
        f"\n{args.calls} calls per case in {args.rounds} interleaved rounds, "
        f"{args.claims} claims per worker, "
        f"claims directory on {filesystem('/tmp')} under /tmp, {redis_version} on loopback, "
        f"event loop {loop_name}\n"
    )
    rows = [
        [
            label,
            f"{case['each_us']['p50']:.2f}",
            f"{case['each_us']['p99']:.2f}",
            f"{case['batched_mean_us']['p50']:.3f}" if case["batched_mean_us"] else "",
        ]
        for label, case in cases.items()
    ]
    print(
        markdown_table(
            ["case", "p50 us (each)", "p99 us (each)", f"p50 of {BATCH}-call batch means, us"],
            rows,
        )
    )

    def p(label: str, q: str = "p50") -> float:
        return cases[label]["each_us"][q]

    ratios = {
        "other_claim_redis_over_file_p50": p(OTHER_REDIS) / p(OTHER_FILE),
        "other_claim_redis_over_file_p99": p(OTHER_REDIS, "p99") / p(OTHER_FILE, "p99"),
        "create_redis_over_file_p50": p(CREATE_REDIS) / p(CREATE_FILE),
        "create_redis_over_file_p99": p(CREATE_REDIS, "p99") / p(CREATE_FILE, "p99"),
    }
    print()
    print(
        markdown_table(
            ["ratio (same run)", "p50", "p99"],
            [
                [
                    "another worker's claim: Redis / file",
                    f"{ratios['other_claim_redis_over_file_p50']:.1f}x",
                    f"{ratios['other_claim_redis_over_file_p99']:.1f}x",
                ],
                [
                    "session-start claim (create): Redis / file",
                    f"{ratios['create_redis_over_file_p50']:.1f}x",
                    f"{ratios['create_redis_over_file_p99']:.1f}x",
                ],
            ],
        )
    )
    print(
        f"\ntargets: own <= 1 us p50 (measured {p(OWN):.2f}), "
        f"other (file) <= 10 us p50 ({p(OTHER_FILE):.2f})"
    )
    report = {
        "machine": machine,
        "calls": args.calls,
        "rounds": args.rounds,
        "claims_per_worker": args.claims,
        "filesystem": filesystem("/tmp"),
        "redis": redis_version,
        "redis_client": redis_client_note(),
        "event_loop": loop_name,
        "unit": "microseconds per awaited call, each timed with a perf_counter_ns pair",
        "cases": cases,
        "ratios_same_run": ratios,
        "targets_us_p50": {"own": 1.0, "other_file": 10.0},
    }
    path = _common.write_json("claim_lookup", report)

    def plot(axes):  # type: ignore[no-untyped-def]
        short = {
            OWN: "own claim\n(memory)",
            OTHER_FILE: "other worker's\nfile",
            OTHER_REDIS: "other worker's\nRedis",
            UNCLAIMED_FILE: "unclaimed\nfile",
            UNCLAIMED_REDIS: "unclaimed\nRedis",
            CREATE_FILE: "create\nfile",
            CREATE_REDIS: "create\nRedis",
        }
        values = [cases[label]["each_us"]["p50"] for label in short]
        _common.bars(axes, list(short.values()), values, "p50 us per call", fmt="%.1f")
        axes.set_yscale("log")
        axes.set_title("Claim lookup and claim cost per call: file vs Redis (p50)")

    _common.figure("claim_lookup", plot, size=(8, 4.5))
    print(f"wrote {path} and claim_lookup.png")


def server_version(server: RedisProcess) -> str:
    """``redis-server`` version line, short."""
    shown = subprocess.run(
        [server.program, "--version"], capture_output=True, text=True, check=False
    ).stdout.split()
    version = next((word for word in shown if word.startswith("v=")), "v=?")
    return f"redis-server {version[2:]}"


def redis_client_note() -> str:
    """The redis-py version and whether its C parser (hiredis) is installed."""
    import redis

    try:
        import hiredis  # noqa: F401
    except ImportError:
        parser = "pure-Python reply parser (hiredis not installed)"
    else:
        parser = "hiredis reply parser"
    return f"redis-py {redis.__version__}, {parser}"


def filesystem(path: str) -> str:
    """The filesystem type holding ``path`` (from /proc/mounts)."""
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs_type = line.split()[:3]
            if path.startswith(mount_point) and len(mount_point) > len(best):
                best, kind = mount_point, fs_type
    return kind


if __name__ == "__main__":
    main()
