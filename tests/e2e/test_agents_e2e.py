"""Agent servers with real processes: /run against env servers, agent sessions, worker death."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from envs.counter_load import client_session, make_episodes
from tests.services import claim_owner

pytestmark = pytest.mark.e2e

ENV = "envs.counter:CounterEnv"
AGENT = "envs.counter_agent:CounterAgent"


def run_body(env_url: str, episode, model_url: str | None = None) -> dict:
    body = {"env_url": env_url, "task": episode.task}
    if model_url:
        body["model"] = {"base_url": model_url, "name": "fake"}
    return body


async def run_all(agent_url: str, env_url: str, n: int, model_url: str | None = None):
    async with client_session() as client:

        async def one(episode):
            body = run_body(env_url, episode, model_url)
            async with client.post(agent_url + "/run", json=body) as reply:
                return reply.status, await reply.json()

        return await asyncio.gather(*[one(e) for e in make_episodes(n, seed=5)])


def test_200_runs_with_a_model_at_4_and_4_workers(serve):
    env = serve(ENV, workers=4)
    model = serve("tests.e2e.fake_model:app")
    agent = serve(AGENT, "--allow-env", env.url, "--allow-model", model.url, workers=4)
    results = asyncio.run(run_all(agent.url, env.url, 200, model.url))
    rewards = [data.get("reward") for status, data in results]
    assert rewards.count(1.0) == 200, [d for s, d in results if s != 200][:3]
    assert all(data["episode_length"] >= 3 for _, data in results)
    # Every env session was closed by its /run, on whichever worker held it.
    assert all(env.health()["sessions"] == 0 for _ in range(12))


def test_runs_fail_when_the_env_server_does_not_route(serve):
    # The same runs as above: between its env requests each run waits for the
    # model, so the agent's pooled connections carry every session in turn.
    env = serve(ENV, "--no-routing", workers=4)
    model = serve("tests.e2e.fake_model:app")
    agent = serve(AGENT, "--allow-env", env.url, "--allow-model", model.url, workers=4)
    results = asyncio.run(run_all(agent.url, env.url, 200, model.url))
    correct = sum(1 for status, data in results if status == 200 and data["reward"] == 1.0)
    print(f"\n/run with the env server at 4 workers, --no-routing: {correct} of 200 scored 1.0")
    assert correct < 190
    failed = [data for status, data in results if status != 200]
    assert all(data["error"]["code"] == "bad_gateway" for data in failed)


def test_200_agent_session_sequences_stay_consistent(serve):
    agent = serve(AGENT, workers=4)

    async def sequence(client, index: int) -> bool:
        sid = f"agent-{index}"
        names = {"agent_session_id": sid, "session_key": f"key-of-{sid}-" + "k" * 16}
        async with client.post(agent.url + "/v1/agent_sessions", json=names) as reply:
            cookie = reply.cookies["gym_session"].value
        headers = {"Cookie": f"gym_session={cookie}"}
        values = [index, 1, 2, 3]
        for value in values:
            async with client.post(
                agent.url + "/remember", json={"value": value}, headers=headers
            ) as reply:
                await reply.read()
        # Closed by id and key, without the cookie: reaches the seeding worker.
        async with client.post(agent.url + "/v1/agent_sessions/close", json=names) as reply:
            receipt = await reply.json()
        return receipt == {
            "agent_session_id": sid,
            "outcome": "closed",
            "count": len(values),
            "total": sum(values),
        }

    async def main():
        async with client_session() as client:
            return await asyncio.gather(*[sequence(client, i) for i in range(200)])

    assert all(asyncio.run(main()))


def test_sigkilled_agent_worker_gives_exactly_its_agent_sessions_410(serve):
    agent = serve(AGENT, workers=4)
    (runtime_dir,) = agent.runtime_dirs()

    async def main():
        async with client_session() as client:
            cookies = {}
            for i in range(40):
                sid = f"s{i}"
                async with client.post(
                    agent.url + "/v1/agent_sessions", json={"agent_session_id": sid}
                ) as reply:
                    cookies[sid] = reply.cookies["gym_session"].value
            owners = {sid: claim_owner(runtime_dir, sid) for sid in cookies}
            victim = max(set(owners.values()), key=list(owners.values()).count)
            os.kill(int(victim.split("-")[0]), signal.SIGKILL)
            await asyncio.sleep(0.5)
            statuses = {}
            for sid, cookie in cookies.items():
                async with client.post(
                    agent.url + "/remember",
                    json={"value": 1},
                    headers={"Cookie": f"gym_session={cookie}"},
                ) as reply:
                    first = reply.status
                async with client.post(
                    agent.url + "/v1/agent_sessions/close",
                    json={"agent_session_id": sid},
                    headers={"Cookie": f"gym_session={cookie}"},
                ) as reply:
                    statuses[sid] = (first, reply.status)
            return owners, victim, statuses

    owners, victim, statuses = asyncio.run(main())
    lost = {sid for sid, owner in owners.items() if owner == victim}
    assert lost and len(lost) < len(owners)
    for sid, pair in statuses.items():
        assert pair == ((410, 410) if sid in lost else (200, 200)), (sid, pair)


def test_run_errors_name_the_cause_and_still_close_the_env_session(serve):
    env = serve("tests.e2e.failing_env:FailingEnv")
    with socket_free_port() as dead_url:
        agent = serve(
            "tests.e2e.scripted_agent:ScriptedAgent",
            "--allow-env",
            env.url,
            "--allow-env",
            f"dead={dead_url}",
        )

    async def run(body):
        async with client_session() as client, client.post(agent.url + "/run", json=body) as reply:
            return reply.status, await reply.json()

    status, data = asyncio.run(run({"env_url": env.url, "actions": [0, 0]}))
    assert status == 200 and data["episode_length"] == 2 and data["reward"] == 2.0
    status, data = asyncio.run(run({"env_url": env.url, "actions": [0, 1, 0]}))
    assert status == 502
    assert data["error"]["code"] == "bad_gateway"
    assert "/step" in data["error"]["message"] and "env_error" in data["error"]["message"]
    assert env.health()["sessions"] == 0  # closed in the finally
    status, data = asyncio.run(run({"env_url": "dead", "actions": [0]}))
    assert status == 502
    assert dead_url in data["error"]["message"]


class socket_free_port:
    """A URL on a loopback port where nothing listens."""

    def __enter__(self) -> str:
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        return None
