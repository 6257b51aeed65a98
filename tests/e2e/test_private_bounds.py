"""A flood of connections to private TCP ports cannot take a host's public port (#20 item 5).

A real ``gym-sessions serve --claims redis://...`` with 2 workers, started with a
low descriptor limit (``prlimit --nofile=512``, so each worker's private
listener holds at most 128 connections), while thousands of silent and
half-sent connections keep arriving at both workers' private TCP ports: honest
counter episodes on the public port (most requests forwarded between the
workers over those same private ports, signed) must still score 1.0, and no
worker may come near its descriptor limit.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import subprocess
import sys
import threading
import time

import aiohttp
import pytest
import redis

from envs.counter_load import make_episodes, play
from gym_sessions.routing.keys import REGISTRATION_PREFIX
from gym_sessions.server.process import start_server
from tests.services import wait_for_registrations

from ..conftest import require_or_skip

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
NOFILE = 512
CAP = NOFILE // 4  # private_listener.default_max_connections() under that limit
FLOODED = 4000  # connections opened in all, at least
KEEP_OPEN = 3000  # connections the flood holds at most (its own descriptors)


@pytest.fixture
def host(redis_server, short_tmp):
    require_or_skip("prlimit", "util-linux")
    server = start_server(
        COUNTER,
        "--claims",
        redis_server.url,
        workers=2,
        tmpdir=short_tmp,
        secret=secrets.token_hex(32),
        launcher=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"),
    )
    try:
        yield server
    finally:
        server.stop()


def _private_addresses(redis_url: str, worker_ids: set[str]) -> list[tuple[str, int]]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        addresses = []
        for worker_id in worker_ids:
            address = client.get(REGISTRATION_PREFIX + worker_id).rpartition("|")[0]
            host, _, port = address.rpartition(":")
            addresses.append((host, int(port)))
        return addresses
    finally:
        client.close()


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# The flood runs in a process of its own: in this one it would compete with the
# honest client for the GIL and slow it down, whatever the server does.
_FLOOD = r"""
import json, selectors, socket, sys, time

addresses = [tuple(a) for a in json.loads(sys.argv[1])]
keep = int(sys.argv[2])
opened = failed = closed_by_server = 0
open_ = []


def sweep():
    global closed_by_server, open_
    still = []
    for sock in open_:
        try:
            gone = sock.recv(65536, socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:
            closed_by_server += 1
            sock.close()
        else:
            still.append(sock)
    open_ = still


selector = selectors.DefaultSelector()
selector.register(sys.stdin, selectors.EVENT_READ)
while not selector.select(0):  # until the test closes our stdin
    for i, address in enumerate(addresses * 50):
        try:
            sock = socket.create_connection(address, timeout=1)
        except OSError:
            failed += 1
            continue
        opened += 1
        if (opened + i) % 2:
            sock.sendall(b"POST /step HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        sock.setblocking(False)  # the sweep only looks
        open_.append(sock)
    sweep()
    if len(open_) > keep:  # our own descriptors: let go of the oldest
        for sock in open_[: len(open_) - keep]:
            sock.close()
        del open_[: len(open_) - keep]
    print(json.dumps({"opened": opened}), flush=True)
time.sleep(0.5)
sweep()
print(json.dumps({"opened": opened, "failed": failed, "closed_by_server": closed_by_server,
                  "still_open": len(open_)}), flush=True)
"""


async def _play_episodes(url: str, n: int) -> list:
    episodes = make_episodes(n, seed=random.randrange(2**32))
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout
    ) as client:
        for episode in episodes:
            try:
                await play(client, url, episode)
            except (aiohttp.ClientError, TimeoutError) as exc:
                episode.error_codes.append(repr(exc))
    return episodes


def test_a_private_connection_flood_cannot_take_the_public_port(host, redis_server):
    addresses = _private_addresses(redis_server.url, wait_for_registrations(redis_server.url, 2))
    pids = host.worker_pids()
    assert len(pids) == 2 and len(addresses) == 2
    most_fds = {pid: _open_fds(pid) for pid in pids}
    flood = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, json.dumps(addresses), str(KEEP_OPEN)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert flood.stdout is not None and flood.stdin is not None
        while json.loads(flood.stdout.readline())["opened"] < 2 * len(addresses) * (CAP + 64):
            pass  # both private listeners are past their cap
        lines: list[str] = []  # read on, so the flood never waits on a full pipe
        reader = threading.Thread(target=lambda: lines.extend(flood.stdout))
        reader.start()
        played: list = []
        player = threading.Thread(
            target=lambda: played.extend(asyncio.run(_play_episodes(host.url, 30)))
        )
        player.start()
        while player.is_alive():
            for pid in pids:
                most_fds[pid] = max(most_fds[pid], _open_fds(pid))
            time.sleep(0.05)
        player.join()
        deadline = time.monotonic() + 60
        while not lines or json.loads(lines[-1])["opened"] < FLOODED:  # the flood goes on
            assert time.monotonic() < deadline and flood.poll() is None, lines[-1:]
            for pid in pids:
                most_fds[pid] = max(most_fds[pid], _open_fds(pid))
            time.sleep(0.05)
        flood.stdin.close()
        reader.join(30)
        stats = json.loads(lines[-1])
    finally:
        flood.kill()
        flood.wait()
    # Every honest episode (most requests forwarded over the flooded ports) scored 1.0.
    failures = [(e.statuses, e.error_codes) for e in played if e.reward != 1.0]
    assert len(played) == 30 and not failures, failures[:3]
    # No worker came near its descriptor limit; none died.
    for pid in pids:
        assert most_fds[pid] < NOFILE - 128, (pid, most_fds[pid])
    assert host.worker_pids() == pids
    assert "failed" in stats, stats
    # Thousands of connections, all but the listeners' caps closed by the listeners.
    assert stats["opened"] >= FLOODED, stats
    assert stats["still_open"] <= len(addresses) * CAP, stats
    assert stats["closed_by_server"] >= stats["opened"] - KEEP_OPEN, stats
