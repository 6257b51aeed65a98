"""Two "hosts" whose clocks disagree: one runs under libfaketime, behind nginx round robin.

Like ``test_multihost_e2e.py``: one real redis-server, two ``gym-sessions serve
--workers 2 --claims redis://... --secret-file PATH`` process groups, nginx
round robin in front and a new connection per request, so most requests of an
episode land on the host that did not mint its cookie. Host 1 runs with
libfaketime preloaded (``LD_PRELOAD`` + ``FAKETIME``, inherited by the workers
uvicorn spawns), its wall clock shifted by +0.5 s, +2 s or -2 s; monotonic
clocks stay real, as on two real hosts. Before the fix a cookie minted on the
host ahead was refused on the other ("Signature age -1 < 0") and its
session's requests got 404.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
from itsdangerous.encoding import base64_decode, bytes_to_int

from envs.counter_load import client_session, make_episodes, play_all, play_over_mcp
from gym_sessions.credentials import CLOCK_SKEW_SECONDS
from gym_sessions.secret_source import write_secret_file
from gym_sessions.server.process import ServerProcess, start_server
from tests.e2e.test_multihost_e2e import Deployment, served_by_one_worker
from tests.services import NginxProcess, require, wait_for_registrations

from ..conftest import require_or_skip

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # several hosts: run by make test-slow

COUNTER = "envs.counter:CounterEnv"
EPISODES = 200
MCP_EPISODES = 40
WINDOW = "2"
WORKERS_PER_HOST = 2
#: Sequential starts on the skewed host that measure its workers' clocks.
PROBES = 60


def faketime_env(offset: float) -> dict[str, str]:
    """The environment that runs a process (and its children) ``offset`` seconds off."""
    require_or_skip("faketime", "faketime")
    program = require("faketime", "faketime")
    # Ask faketime which library it preloads (distributions put it in different places);
    # it cannot be the launcher itself: it forks, and would stand between us and the server.
    probe = subprocess.run(
        [program, "-f", "+0s", "printenv", "LD_PRELOAD"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    library = probe.stdout.strip()
    assert "faketime" in library, probe
    preload = " ".join(filter(None, [library, os.environ.get("LD_PRELOAD")]))
    return {
        "LD_PRELOAD": preload,
        "FAKETIME": f"{offset:+g}s",
        # Hosts' wall clocks disagree; their monotonic clocks are their own business.
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


# The same deployment as the multi-host tests; hosts[1] runs off by the offset.
SkewedDeployment = Deployment


@pytest.fixture
def deploy_skewed(
    redis_server, short_tmp, tmp_path
) -> Iterator[Callable[[float], SkewedDeployment]]:
    """``deploy_skewed(offset)``: host 0 on the real clock, host 1 ``offset`` s off, nginx."""
    require_or_skip("nginx", "nginx")
    require_or_skip("faketime", "faketime")
    secret_file = str(tmp_path / "secret")
    write_secret_file(secret_file, secrets.token_hex(32))
    hosts: list[ServerProcess] = []
    proxies: list[NginxProcess] = []

    def _deploy(offset: float) -> SkewedDeployment:
        skewed = faketime_env(offset)
        for index, env in enumerate([None, skewed]):
            hosts.append(
                start_server(
                    COUNTER, "--claims", redis_server.url, "--secret-file", secret_file,
                    "--window", WINDOW, "--debug-worker-header", workers=WORKERS_PER_HOST,
                    tmpdir=os.path.join(short_tmp, f"h{index}"), env=env,
                )
            )  # fmt: skip
        wait_for_registrations(redis_server.url, 2 * WORKERS_PER_HOST)
        proxies.append(NginxProcess([host.url for host in hosts]))
        proxies[-1].start()
        return SkewedDeployment(redis_server, hosts, proxies[-1])

    yield _deploy
    for proxy in proxies:
        proxy.close()
    for host in hosts:
        host.stop()


def cookie_timestamp(cookie: str) -> int:
    """The signing time (whole seconds) an itsdangerous cookie carries; no secret needed."""
    return bytes_to_int(base64_decode(cookie.rsplit(".", 2)[1]))


def measure_worker_clocks(d: SkewedDeployment, host: int) -> dict[str, tuple[float, float]]:
    """For each worker of ``host`` that minted a probe's cookie: bounds on its clock's offset.

    A cookie minted at true time ``t`` in ``[before, after]`` by a clock ``o`` off
    carries ``floor(t + o)``, so ``ts - after <= o < ts + 1 - before``. Probes
    spread over a few seconds narrow the bounds to about a tenth of a second.
    """
    bounds: dict[str, tuple[float, float]] = {}
    for index in range(PROBES):
        session_id = uuid.uuid4().hex
        body = {
            "resources_session_id": session_id,
            "session_key": secrets.token_urlsafe(24),
            "options": {"initial_count": 0},
        }
        request = urllib.request.Request(
            d.hosts[host].url + "/reset",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        before = time.time()
        with urllib.request.urlopen(request, timeout=30) as reply:
            set_cookie = reply.headers["Set-Cookie"]
        after = time.time()
        cookie = set_cookie.split(";", 1)[0].split("=", 1)[1]
        stamp = cookie_timestamp(cookie)
        worker = d.holder(session_id)
        assert worker is not None
        time.sleep(0.037 + 0.011 * (index % 3))  # spread the probes over the second
        if d.host_of(worker) != host:
            continue  # balanced placement opened it on the other host: its clock is right
        low, high = bounds.get(worker, (float("-inf"), float("inf")))
        bounds[worker] = (max(low, stamp - after), min(high, stamp + 1 - before))
    return bounds


@pytest.mark.parametrize("offset", [0.5, 2.0, -2.0], ids=["ahead-0.5s", "ahead-2s", "behind-2s"])
def test_episodes_all_score_with_one_hosts_clock_off(deploy_skewed, offset):
    assert abs(offset) <= CLOCK_SKEW_SECONDS
    d = deploy_skewed(offset)

    # The fake clock really reaches every worker of host 1 (spawned by uvicorn).
    clocks = measure_worker_clocks(d, host=1)
    print(f"\nhost 1 at {offset:+g} s: worker clock offsets within {clocks}")
    assert len(clocks) == WORKERS_PER_HOST, clocks
    for worker, (low, high) in clocks.items():
        assert offset - 0.3 < low < high < offset + 0.3, (worker, low, high)

    episodes = asyncio.run(play_all(d.url, make_episodes(EPISODES, seed=23)))
    failed = [(e.statuses, e.error_codes) for e in episodes if e.reward != 1.0]
    assert [e.reward for e in episodes].count(1.0) == EPISODES, (len(failed), failed[:5])
    statuses = [status for e in episodes for status in e.statuses]
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    # Sessions lived on both hosts, so cookies minted on each were read on the other.
    assert {d.host_of(holder) for holder in served_by_one_worker(episodes)} == {0, 1}

    # MCP tokens (Fernet) minted on either host, used through nginx with only the token.
    async def mcp_episodes():
        async with client_session() as client:
            return await asyncio.gather(
                *[play_over_mcp(client, d.url, e) for e in make_episodes(MCP_EPISODES, seed=24)]
            )

    mcp = asyncio.run(mcp_episodes())
    assert [e.reward for e in mcp] == [1.0] * MCP_EPISODES, [e.error_codes for e in mcp][:5]
    assert {status for e in mcp for status in e.statuses} == {200}
