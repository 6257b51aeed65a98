"""Which fraction of a session's requests needs a hop, per kind of client, at 4 workers.

Counter episodes (typed reset, 3-6 steps, verify, close) against a 4-worker
routed server, from three clients:

- (a) ``RemoteEnv`` (``gymnasium.make("gym_sessions/Remote-v0", url=...)``),
  one kept-alive connection per session, 32 sessions at a time in threads;
- (b) a pooled client: one aiohttp client whose pool of at most 16
  kept-alive connections is shared by all sessions (32 episodes in flight),
  each request on whichever connection aiohttp's pool hands out;
- (c) a new connection for every request (32 episodes in flight).

Each session request is classified without any product change: a request is
*forwarded* when the worker that accepted its connection is not the worker
whose claim file names the session (`tests.services.claim_owner`), else
*local*. The accepting worker is learned

- for (a) and (b), whose connections are chosen inside ``RemoteEnv`` and
  aiohttp, from ``/proc``: the server process holding the server end of the
  request's TCP connection, looked up after the reply while the kept-alive
  connection is still open (``http.client`` is wrapped, and the aiohttp
  connector subclassed, only to note each request's local port);
- for (c), the benchmark's own client, by ``GET /health`` on the same
  connection right after the request (health is never forwarded).

    .venv/bin/python benchmarks/forwarded_fraction.py [--episodes 300] [--pool-size 16]
                                                      [--in-flight 32] [--placement balanced|local]

Prints a Markdown table; writes forwarded_fraction.json and .png
into --out DIR (default benchmarks/results/local/, untracked).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import _common
import aiohttp
import gymnasium
from _common import markdown_table

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from envs.counter_load import Episode, make_episodes, play
from gym_sessions.server.process import ServerProcess, start_server
from tests.services import claim_owner

TARGET = "envs.counter:CounterEnv"
WORKERS = 4
POOL_SIZE = 16
IN_FLIGHT = 32
SESSION_PATHS = ("reset", "step", "verify", "close_session")
REMOTE_ENV = "(a) RemoteEnv, one kept-alive connection per session"
POOLED = "(b) aiohttp pool, <= {} kept-alive connections shared"
FRESH = "(c) new connection per request"

# A request's record: (path, accepting worker's pid (a, b) or id (c), episode).
Record = tuple[str, str | None, Episode]


# (a) RemoteEnv, classified from /proc -------------------------------------------------------

_noted = threading.local()
_original_request = http.client.HTTPConnection.request
_original_getresponse = http.client.HTTPConnection.getresponse


def _noting_request(self: http.client.HTTPConnection, method: str, url: str, *a: Any, **k: Any):
    self._bench_path = url  # type: ignore[attr-defined]
    return _original_request(self, method, url, *a, **k)


def _noting_getresponse(self: http.client.HTTPConnection) -> http.client.HTTPResponse:
    response = _original_getresponse(self)
    sink = getattr(_noted, "sink", None)
    if sink is not None:
        # Looked up before the client reads the reply, while the connection is open.
        pid = _common.accepting_pid(sink["server_pid"], sink["port"], self.sock.getsockname()[1])
        sink["records"].append((self._bench_path.rsplit("/", 1)[1], pid))  # type: ignore[attr-defined]
    return response


def remote_env_episode(server: ServerProcess, episode: Episode) -> list[Record]:
    _noted.sink = {
        "server_pid": server.process.pid,
        "port": _common.port_of(server.url),
        "records": [],
    }
    try:
        env = gymnasium.make("gym_sessions/Remote-v0", url=server.url)
        try:
            options = {"initial_count": episode.initial, "expected_count": episode.expected}
            env.reset(options=options)
            episode.session_id = env.unwrapped.session_id
            for step in episode.increments:
                env.step(step)
            episode.reward = env.unwrapped.verify()["reward"]
        finally:
            env.close()
        records = _noted.sink["records"]
    finally:
        _noted.sink = None
    return [
        (path, None if pid is None else str(pid), episode)
        for path, pid in records
        if path in SESSION_PATHS
    ]


def run_remote_env(server: ServerProcess, episodes: list[Episode], threads: int) -> list[Record]:
    http.client.HTTPConnection.request = _noting_request  # type: ignore[method-assign]
    http.client.HTTPConnection.getresponse = _noting_getresponse  # type: ignore[method-assign]
    try:
        with ThreadPoolExecutor(threads) as pool:
            done = pool.map(lambda e: remote_env_episode(server, e), episodes)
            return [record for records in done for record in records]
    finally:
        http.client.HTTPConnection.request = _original_request  # type: ignore[method-assign]
        http.client.HTTPConnection.getresponse = _original_getresponse  # type: ignore[method-assign]


# (b) aiohttp's own pool, classified from /proc ---------------------------------------------

_TAG = "X-Bench-Request"


class NotingConnector(aiohttp.TCPConnector):
    """aiohttp's connector, noting the local port of the connection each tagged request gets."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ports: dict[str, tuple[int, Any]] = {}

    async def connect(self, req: Any, traces: Any, timeout: Any) -> Any:  # noqa: ASYNC109
        connection = await super().connect(req, traces, timeout)
        tag = req.headers.get(_TAG)
        if tag is not None:
            port = connection.transport.get_extra_info("sockname")[1]
            self.ports[tag] = (port, connection.protocol)
        return connection


class _NotedPost:
    def __init__(self, client: EpisodeClient, url: str, kwargs: dict[str, Any]) -> None:
        self.client, self.url = client, url
        self.tag = str(next(client.shared.tags))
        headers = {**(kwargs.pop("headers", None) or {}), _TAG: self.tag}
        self.context = client.shared.session.post(url, headers=headers, **kwargs)

    async def __aenter__(self) -> aiohttp.ClientResponse:
        return await self.context.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self.context.__aexit__(*exc)
        shared = self.client.shared
        port, protocol = shared.connector.ports.pop(self.tag)
        key = (port, id(protocol))
        if key not in shared.pids:  # one /proc lookup per connection
            pid = _common.accepting_pid(shared.server_pid, shared.server_port, port)
            shared.pids[key] = (None if pid is None else str(pid), protocol)
        path = self.url.rsplit("/", 1)[1]
        shared.records.append((path, shared.pids[key][0], self.client.episode))


class SharedPool:
    """One aiohttp client (pool of ``limit`` kept-alive connections) for all episodes."""

    def __init__(self, server: ServerProcess, limit: int) -> None:
        self.server_pid = server.process.pid
        self.server_port = _common.port_of(server.url)
        self.connector = NotingConnector(limit=limit)
        self.session = aiohttp.ClientSession(
            connector=self.connector, cookie_jar=aiohttp.DummyCookieJar()
        )
        self.tags = itertools.count()
        self.pids: dict[tuple[int, int], tuple[str | None, Any]] = {}
        self.records: list[Record] = []


class EpisodeClient:
    """Duck-types the ``post`` that `envs.counter_load.play` uses, for one episode."""

    def __init__(self, shared: SharedPool, episode: Episode) -> None:
        self.shared, self.episode = shared, episode

    def post(self, url: str, **kwargs: Any) -> _NotedPost:
        return _NotedPost(self, url, kwargs)


async def run_pooled(
    server: ServerProcess, episodes: list[Episode], limit: int, in_flight: int
) -> list[Record]:
    shared = SharedPool(server, limit)
    gate = asyncio.Semaphore(in_flight)

    async def one(episode: Episode) -> None:
        async with gate:
            await play(EpisodeClient(shared, episode), server.url, episode)  # type: ignore[arg-type]

    try:
        await asyncio.gather(*[one(e) for e in episodes])
    finally:
        await shared.session.close()
    return shared.records


# (c) a new connection per request, classified by GET /health on it --------------------------


class FreshConnectionClient:
    """Duck-types `play`'s ``post``: a new connection per request, then ``GET /health`` on it."""

    def __init__(self, url: str, records: list[Record], episode: Episode) -> None:
        self.url, self.records, self.episode = url, records, episode

    def post(self, url: str, **kwargs: Any) -> _FreshPost:
        return _FreshPost(self, url, kwargs)


class _FreshPost:
    def __init__(self, client: FreshConnectionClient, url: str, kwargs: dict[str, Any]) -> None:
        self.client, self.url, self.kwargs = client, url, kwargs
        self.opened = 0

    async def _on_open(self, *_: Any) -> None:
        self.opened += 1

    async def __aenter__(self) -> aiohttp.ClientResponse:
        trace = aiohttp.TraceConfig()
        trace.on_connection_create_end.append(self._on_open)
        # limit=1 and keep-alive: the health check reuses the request's connection.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1),
            cookie_jar=aiohttp.DummyCookieJar(),
            trace_configs=[trace],
        )
        self.context = self.session.post(self.url, **self.kwargs)
        return await self.context.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.context.__aexit__(*exc)
            async with self.session.get(self.client.url + "/health") as reply:
                worker = (await reply.json())["worker"]
            same_connection = self.opened == 1
            path = self.url.rsplit("/", 1)[1]
            self.client.records.append(
                (path, worker if same_connection else None, self.client.episode)
            )
        finally:
            await self.session.close()


async def run_fresh(url: str, episodes: list[Episode], in_flight: int) -> list[Record]:
    records: list[Record] = []
    gate = asyncio.Semaphore(in_flight)

    async def one(episode: Episode) -> None:
        async with gate:
            await play(FreshConnectionClient(url, records, episode), url, episode)  # type: ignore[arg-type]

    await asyncio.gather(*[one(e) for e in episodes])
    return records


# Classification -------------------------------------------------------------------------------


def classify(records: list[Record], runtime: str, by_pid: bool) -> dict[str, Any]:
    owners: dict[str, str | None] = {}
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    accepting: collections.Counter[str] = collections.Counter()
    for path, worker, episode in records:
        sid = episode.session_id
        if sid not in owners:
            owners[sid] = claim_owner(runtime, sid)
        owner = owners[sid]
        if owner is not None and by_pid:
            owner = str(_common.worker_pid(owner))
        if worker is None or owner is None:
            kind = "unknown"
        else:
            kind = "local" if worker == owner else "forwarded"
            accepting[worker] += 1
        counts[path][kind] += 1
        counts["all"][kind] += 1
        if path != "reset":
            counts["all but reset"][kind] += 1
    return {
        "by_path": {path: dict(counter) for path, counter in counts.items()},
        "requests_per_accepting_worker": dict(accepting),
    }


def fraction(counter: dict[str, int]) -> str:
    known = counter.get("local", 0) + counter.get("forwarded", 0)
    if not known:
        return "n/a"
    share = counter.get("forwarded", 0) / known
    unknown = counter.get("unknown", 0)
    tail = f", {unknown} unclassified" if unknown else ""
    return f"{100 * share:.1f}% ({counter.get('forwarded', 0)}/{known}{tail})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--pool-size", type=int, default=POOL_SIZE, help="(b)'s connection limit")
    parser.add_argument("--in-flight", type=int, default=IN_FLIGHT, help="episodes at a time")
    parser.add_argument(
        "--placement", choices=("balanced", "local"), default="local", help="the server's"
    )
    args = _common.parse_args(parser)
    print(_common.load_note())

    results: dict[str, Any] = {}
    with start_server(TARGET, "--placement", args.placement, workers=WORKERS) as server:
        runtime = _common.runtime_dir(server)
        clients = (REMOTE_ENV, POOLED.format(args.pool_size), FRESH)
        for i, label in enumerate(clients):
            episodes = make_episodes(args.episodes, seed=100 + i)
            if i == 0:
                records = run_remote_env(server, episodes, args.in_flight)
            elif i == 1:
                run = run_pooled(server, episodes, args.pool_size, args.in_flight)
                records = asyncio.run(run)
            else:
                records = asyncio.run(run_fresh(server.url, episodes, args.in_flight))
            result = classify(records, runtime, by_pid=i < 2)
            result["correct"] = sum(e.reward == 1.0 for e in episodes)
            result["episodes"] = len(episodes)
            results[label] = result
            print(f"  {label}: {fraction(result['by_path']['all'])} forwarded", flush=True)

    print(
        f"\nShare of session requests that needed a hop, {WORKERS} workers, "
        f"{args.episodes} counter episodes per client\n"
    )
    rows = [
        [
            label,
            fraction(r["by_path"]["all"]),
            fraction(r["by_path"]["all but reset"]),
            fraction(r["by_path"].get("step", {})),
            f"{r['correct']}/{r['episodes']}",
        ]
        for label, r in results.items()
    ]
    print(
        markdown_table(
            ["client", "forwarded, all requests", "forwarded, all but reset", "steps", "correct"],
            rows,
        )
    )
    print(
        "\nA reset is always served where it arrives (it claims the session there); "
        "'unclassified' requests are ones whose connection could not be matched."
    )
    path = _common.write_json(
        "forwarded_fraction",
        {
            "machine": _common.machine(),
            "workers": WORKERS,
            "episodes_per_client": args.episodes,
            "pool_size": args.pool_size,
            "in_flight": args.in_flight,
            "clients": results,
        },
    )

    def draw(axes):  # type: ignore[no-untyped-def]
        values = []
        for r in results.values():
            c = r["by_path"]["all but reset"]
            known = c.get("local", 0) + c.get("forwarded", 0)
            values.append(100 * c.get("forwarded", 0) / known if known else 0)
        _common.bars(axes, [label.split(",")[0] for label in results], values, "% forwarded")
        axes.set_ylim(0, 100)
        axes.set_title(f"Requests (all but reset) needing a hop, {WORKERS} workers")

    _common.figure("forwarded_fraction", draw)
    print(f"wrote {path} and forwarded_fraction.png")


if __name__ == "__main__":
    main()
