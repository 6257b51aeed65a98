"""Issue 27's acceptance: consecutive runs of concurrent ``/run`` episodes through the agent.

    PYTHONPATH=$PWD .venv/bin/python -m tests.stress.pooled_runs [RUNS] [EPISODES]

Both servers at 4 workers, default settings (handoff on), one aiohttp client with
a pool of 512, so the agent's own pool to the env server carries many sessions
per kept-alive connection. Only the wait for a reply once sent is bounded
(``sock_read``), not the wait for a pooled connection: a run is judged on its
replies on a shared, loaded machine. After each run: live sessions, then claim
files a window later, then each env worker's handoff ``deliveries``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import sys
import tempfile
import time

import aiohttp

from envs.counter_load import make_episodes
from gym_sessions.server.process import ServerProcess, start_server
from tests.stress import scenarios
from tests.stress.targets import FAULT_DIR_ENV

WINDOW = 5


async def run(agent_url: str, env_url: str, n: int) -> tuple[collections.Counter[str], float]:
    """``n`` concurrent episodes; outcomes ("ok", or status and body, or exception name)."""
    outcomes: collections.Counter[str] = collections.Counter()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=512),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
    ) as client:

        async def one(task: dict) -> None:
            try:
                body = {"env_url": env_url, "task": task}
                async with client.post(agent_url + "/run", json=body) as reply:
                    data = await reply.json(content_type=None)
                    ok = reply.status == 200 and data.get("reward") == 1.0
                    outcomes["ok" if ok else f"{reply.status} {str(data)[:120]}"] += 1
            except Exception as exc:  # counted, not raised: the run goes on
                outcomes[type(exc).__name__] += 1

        began = time.monotonic()
        await asyncio.gather(*[one(e.task) for e in make_episodes(n, seed=n)])
        return outcomes, time.monotonic() - began


async def main(env: ServerProcess, agent: ServerProcess, runs: int, n: int) -> None:
    for i in range(runs):
        outcomes, seconds = await run(agent.url, env.url, n)
        live = await scenarios.live_sessions_left(env, 4)
        claims = await scenarios.claims_left(env, WINDOW)
        healths = await scenarios.worker_healths(env, 4)
        other = {k: v for k, v in outcomes.items() if k != "ok"}
        row = {"run": i + 1, "ok": outcomes["ok"], "of": n, "seconds": round(seconds, 1)}
        print(json.dumps({**row, "other": other, **live.detail, **claims.detail}), flush=True)
        for worker, health in sorted(healths.items()):
            print("   ", worker, json.dumps(health.get("deliveries")), flush=True)


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    episodes = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
    faults = tempfile.mkdtemp(dir="/tmp")
    window = ("--window", str(WINDOW))
    env_target = "tests.stress.targets:FaultyCounterServer"
    with (
        start_server(env_target, *window, workers=4, env={FAULT_DIR_ENV: faults}) as env,
        start_server(
            "envs.counter_agent:CounterAgent", *window, "--allow-env", env.url, workers=4
        ) as agent,
    ):
        asyncio.run(main(env, agent, runs, episodes))
