"""Two "hosts" behind nginx round robin, claims in one real redis-server.

Each host is its own ``gym-sessions serve --workers 2 --claims redis://...
--secret-file PATH`` process group with its own port and temporary directory;
they share nothing but Redis and the secret (one 0600 file). nginx sends each
request to the next host in turn, and every request is on a new connection, so
most requests of an episode land on a worker that does not hold its session.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import redis

from envs.counter_load import Episode, client_session, make_episodes, play, play_all
from gym_sessions.routing.redis_claims import RedisClaimStore
from gym_sessions.secret_source import write_secret_file
from gym_sessions.server.process import ServerProcess
from tests.services import (
    NginxProcess,
    RedisProcess,
    free_port,
    registered_workers,
    wait_for_registrations,
)

from ..conftest import require_or_skip
from .durable_player import LOST, DurablePlayer
from .subprocesses import run_module

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # several hosts: run by make test-slow

COUNTER = "gym_sessions.examples.counter:CounterEnv"  # some tests run outside the repository
EPISODES = 200
WINDOW = "2"
WORKERS_PER_HOST = 2


def served_by_one_worker(episodes: list[Episode]) -> set[str]:
    """The workers that answered ``episodes``, each episode's every request by one.

    Read from the replies (``--debug-worker-header``) as they come, not from
    claims after the batch: a closed session's claim lasts only its window.
    """
    served = [set(e.served_by) for e in episodes]
    assert all(len(workers) == 1 and None not in workers for workers in served), served
    return {worker for (worker,) in served}


@dataclass
class Deployment:
    redis: RedisProcess
    hosts: list[ServerProcess]
    nginx: NginxProcess

    @property
    def url(self) -> str:
        return self.nginx.url

    def holder(self, session_id: str) -> str | None:
        client = redis.Redis.from_url(self.redis.url, decode_responses=True)
        try:
            value = client.get(RedisClaimStore.key(session_id))
            return None if value is None else value.split("|", 1)[0]
        finally:
            client.close()

    def registered_workers(self) -> set[str]:
        return registered_workers(self.redis.url)

    def host_of(self, worker_id: str) -> int:
        pid = int(worker_id.split("-")[0])
        return next(i for i, host in enumerate(self.hosts) if pid in host.worker_pids())


@pytest.fixture
def deploy(serve, private_redis_server, tmp_path) -> Iterator[Callable[..., Deployment]]:
    """``deploy(*args)``: two hosts started with ``args`` and nginx round robin in front."""
    require_or_skip("nginx", "nginx")
    proxies: list[NginxProcess] = []

    def _deploy(*args: str, routed: bool = True, target: str = COUNTER) -> Deployment:
        claims = ("--claims", private_redis_server.url) if routed else ("--no-routing",)
        hosts = [
            serve(target, *claims, "--secret-file", secret_file, "--window", WINDOW, *args,
                  workers=WORKERS_PER_HOST)
            for _ in range(2)
        ]  # fmt: skip
        deployment = Deployment(private_redis_server, hosts, NginxProcess([h.url for h in hosts]))
        if routed:
            wait_for_registrations(private_redis_server.url, 2 * WORKERS_PER_HOST)
        proxies.append(deployment.nginx)
        deployment.nginx.start()
        return deployment

    secret_file = str(tmp_path / "secret")
    write_secret_file(secret_file, secrets.token_hex(32))
    yield _deploy
    for proxy in proxies:
        proxy.close()


def test_200_episodes_through_nginx_over_two_hosts_all_score(deploy):
    d = deploy("--debug-worker-header")
    episodes = asyncio.run(play_all(d.url, make_episodes(EPISODES, seed=11)))
    rewards = [e.reward for e in episodes]
    assert rewards.count(1.0) == EPISODES, [e.error_codes for e in episodes if e.reward != 1.0][:5]
    assert all(status == 200 for e in episodes for status in e.statuses)
    # Sessions live on both hosts, so requests really crossed between them.
    assert {d.host_of(holder) for holder in served_by_one_worker(episodes)} == {0, 1}
    # The claimants remove every claim after the window; registrations stay.
    deadline = time.monotonic() + float(WINDOW) + 5
    while any(d.holder(e.session_id) for e in episodes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(d.holder(e.session_id) for e in episodes)
    assert len(d.registered_workers()) == 2 * WORKERS_PER_HOST


def test_without_routing_two_hosts_lose_state(deploy):
    d = deploy(routed=False)
    episodes = asyncio.run(play_all(d.url, make_episodes(EPISODES, seed=11)))
    correct = [e.reward for e in episodes].count(1.0)
    print(f"\n--no-routing, 2 hosts x 2 workers: {correct} of {EPISODES} episodes scored 1.0")
    assert correct < EPISODES * 0.8


async def _start(client, url: str, episode, cookies: dict[str, str]) -> None:
    body = {
        "resources_session_id": episode.session_id,
        "options": {"initial_count": episode.initial, "expected_count": episode.expected},
    }
    async with client.post(url + "/reset", json=body) as reply:
        assert reply.status == 200, await reply.text()
        cookies[episode.session_id] = reply.cookies["gym_session"].value


async def _finish(client, url: str, episode, cookies: dict[str, str]) -> None:
    headers = {"Cookie": f"gym_session={cookies[episode.session_id]}"}

    async def post(path: str, body=None):
        async with client.post(url + path, json=body, headers=headers) as reply:
            episode.statuses.append(reply.status)
            return reply.status, await reply.json()

    for step in episode.increments:
        await post("/step", {"action": step})
    status, data = await post("/verify")
    if status == 200:
        episode.reward = data["reward"]
    await post("/close_session", {"resources_session_id": episode.session_id})


def _run_with_fault(d: Deployment, fault: Callable[[dict[str, str]], object], n: int = 80):
    """Start ``n`` episodes, apply ``fault(owners)``, finish them; then play fresh ones."""
    episodes = make_episodes(n, seed=12)
    cookies: dict[str, str] = {}

    async def scenario():
        async with client_session() as client:
            await asyncio.gather(*[_start(client, d.url, e, cookies) for e in episodes])
            owners = {e.session_id: d.holder(e.session_id) for e in episodes}
            victim = fault(owners)
            await asyncio.sleep(0.5)
            await asyncio.gather(*[_finish(client, d.url, e, cookies) for e in episodes])
            fresh = await asyncio.gather(
                *[play(client, d.url, e) for e in make_episodes(40, seed=13)]
            )
            return owners, victim, fresh

    return episodes, *asyncio.run(scenario())


def test_sigkill_of_one_worker_of_one_host_gives_exactly_its_sessions_410(deploy):
    d = deploy()

    def kill_busiest(owners: dict[str, str]) -> str:
        victim = max(set(owners.values()), key=list(owners.values()).count)
        os.kill(int(victim.split("-")[0]), signal.SIGKILL)
        return victim

    episodes, owners, victim, fresh = _run_with_fault(d, kill_busiest)
    lost = [e for e in episodes if owners[e.session_id] == victim]
    kept = [e for e in episodes if owners[e.session_id] != victim]
    assert lost and kept
    for e in lost:  # every request, close included, wherever it landed
        assert set(e.statuses) == {410}, e.statuses
    for e in kept:
        assert set(e.statuses) == {200} and e.reward == 1.0, e.statuses
    assert [e.reward for e in fresh].count(1.0) == len(fresh)


def test_stopping_one_host_gives_its_sessions_410_and_the_other_hosts_finish(deploy):
    d = deploy()
    stopped: dict[str, int] = {}

    def stop_host_zero(owners: dict[str, str]) -> int:
        stopped["code"] = d.hosts[0].stop()
        return 0

    # Map owners to hosts before the host goes (its worker pids vanish with it).
    host_of: dict[str, int] = {}

    def stop_after_mapping(owners: dict[str, str]) -> int:
        for owner in set(owners.values()):
            host_of[owner] = d.host_of(owner)
        return stop_host_zero(owners)

    episodes, owners, _, fresh = _run_with_fault(d, stop_after_mapping)
    assert stopped["code"] == 0
    lost = [e for e in episodes if host_of[owners[e.session_id]] == 0]
    kept = [e for e in episodes if host_of[owners[e.session_id]] == 1]
    assert lost and kept
    for e in lost:
        assert set(e.statuses) == {410}, e.statuses
    for e in kept:
        assert set(e.statuses) == {200} and e.reward == 1.0, e.statuses
    assert [e.reward for e in fresh].count(1.0) == len(fresh)
    # The stopped host's workers unregistered on their way out.
    assert len(d.registered_workers()) == WORKERS_PER_HOST


# Start-up -------------------------------------------------------------------------------------


def test_unreachable_redis_at_start_up_is_one_error_line(short_tmp):
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "GYM_SESSIONS_SECRET": secrets.token_hex(32)}
    code, _, stderr = run_module(
        "serve", COUNTER, "--port", "0", "--claims", url, timeout=60, cwd=short_tmp, env=env,
    )  # fmt: skip
    assert code == 2
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith(f"gym-sessions: error: cannot reach the claim store at {url}")
    )


def test_redis_claims_without_a_shared_secret_refuse_to_start(short_tmp, private_redis_server):
    env = {k: v for k, v in os.environ.items() if k != "GYM_SESSIONS_SECRET"}
    code, _, stderr = run_module(
        "serve", COUNTER, "--port", "0", "--claims", private_redis_server.url, timeout=60,
        cwd=short_tmp, env=env,
    )  # fmt: skip
    assert code == 2
    assert "--secret-file" in stderr and "GYM_SESSIONS_SECRET" in stderr


def test_redis_lost_while_serving_gives_503_then_service_resumes(deploy):
    d = deploy()
    episodes = make_episodes(40, seed=14)
    cookies: dict[str, str] = {}
    done: dict[str, int] = {e.session_id: 0 for e in episodes}  # steps applied so far

    async def step(client, e) -> int:
        headers = {"Cookie": f"gym_session={cookies[e.session_id]}"}
        body = {"action": e.increments[done[e.session_id]]}
        async with client.post(d.url + "/step", json=body, headers=headers) as reply:
            data = await reply.json()
            if reply.status == 200:
                done[e.session_id] += 1
            else:
                e.error_codes.append(data["error"]["code"])
            return reply.status

    async def outage() -> list[int]:
        async with client_session() as client:
            await asyncio.gather(*[_start(client, d.url, e, cookies) for e in episodes])
            d.redis.stop()
            return await asyncio.gather(*[step(client, e) for e in episodes])

    statuses = asyncio.run(outage())
    # Served by the claimant from memory, or refused: never run on another worker.
    assert set(statuses) <= {200, 503}
    assert 503 in statuses
    assert {code for e in episodes for code in e.error_codes} == {"claims_unavailable"}

    d.redis.start()  # empty: the workers' heartbeats write their claims back
    deadline = time.monotonic() + 20
    while not all(d.holder(e.session_id) for e in episodes) or len(d.registered_workers()) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.2)

    async def resume() -> list[float | None]:
        async with client_session() as client:

            async def rest(e) -> float | None:
                while done[e.session_id] < len(e.increments):
                    assert await step(client, e) == 200
                # Verify and close (no steps left).
                tail = Episode(e.session_id, e.initial, [])
                await _finish(client, d.url, tail, cookies)
                assert set(tail.statuses) == {200}
                return tail.reward

            return await asyncio.gather(*[rest(e) for e in episodes])

    assert asyncio.run(resume()) == [1.0] * len(episodes)


def test_reload_of_one_host_loses_no_episode(deploy):
    """SIGHUP on one host mid-episodes: its old workers stay registered and keep their
    sessions (the other host forwards to them) until they drain; no episode loses."""
    d = deploy()
    host = d.hosts[0]
    held = make_episodes(12, seed=40)  # open across the reload
    episodes = make_episodes(120, seed=41)  # starting before, during and after it
    cookies: dict[str, str | None] = {}
    registered_while_open: list[bool] = []

    async def hold(client, episode: Episode) -> None:
        body = {
            "resources_session_id": episode.session_id,
            "session_key": episode.session_key,
            "options": {"initial_count": episode.initial, "expected_count": episode.expected},
        }
        async with client.post(d.url + "/reset", json=body) as reply:
            assert reply.status == 200
            cookies[episode.session_id] = reply.cookies["gym_session"].value

    async def finish_held(client) -> None:
        for episode in held:
            headers = {"Cookie": f"gym_session={cookies[episode.session_id]}"}
            for step in episode.increments:
                async with client.post(
                    d.url + "/step", json={"action": step}, headers=headers
                ) as reply:
                    episode.statuses.append(reply.status)
            async with client.post(d.url + "/verify", json={}, headers=headers) as reply:
                episode.statuses.append(reply.status)
                episode.reward = (await reply.json()).get("reward")

    async def one(client, index: int, episode: Episode) -> None:
        await asyncio.sleep(index * 0.03)
        await play(client, d.url, episode)

    async def main() -> None:
        async with client_session() as client:
            for episode in held:
                await hold(client, episode)
            on_host = {
                d.holder(e.session_id)
                for e in held
                if int(d.holder(e.session_id).split("-")[0]) in host.worker_pids()
            }
            assert on_host  # some held sessions live on the host being reloaded

            async def reload() -> None:
                await asyncio.sleep(1.0)
                host.process.send_signal(signal.SIGHUP)
                await asyncio.sleep(2.5)  # new workers up, old ones draining
                registered_while_open.append(on_host <= d.registered_workers())
                await finish_held(client)

            await asyncio.gather(reload(), *[one(client, i, e) for i, e in enumerate(episodes)])
            return on_host

    old_workers = asyncio.run(main())
    for group in (held, episodes):
        assert [e.reward for e in group] == [1.0] * len(group), [
            e.error_codes for e in group if e.reward != 1.0
        ][:5]
        assert {s for e in group for s in e.statuses} == {200}
    assert registered_while_open == [True]
    # Their sessions ended: the drained workers leave; the host serves on with new ones.
    deadline = time.monotonic() + 30
    while old_workers & d.registered_workers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not old_workers & d.registered_workers()
    assert len(d.registered_workers()) == 2 * WORKERS_PER_HOST


def test_an_evicting_redis_is_refused_at_start_up(short_tmp, private_redis_server, tmp_path):
    client = redis.Redis.from_url(private_redis_server.url)
    client.config_set("maxmemory", "64mb")
    client.config_set("maxmemory-policy", "volatile-lru")
    client.close()
    secret_file = str(tmp_path / "secret")
    write_secret_file(secret_file, secrets.token_hex(32))
    code, _, stderr = run_module(
        "serve", COUNTER, "--port", "0", "--claims", private_redis_server.url,
        "--secret-file", secret_file, timeout=60, cwd=short_tmp,
    )  # fmt: skip
    assert code == 2
    assert "maxmemory-policy volatile-lru" in stderr and "noeviction" in stderr


def test_a_worker_busy_with_a_long_step_is_not_taken_for_gone(deploy):
    """A 12 s step blocks its worker's event loop past the 10 s registration: its
    other sessions wait for it (200 afterwards), never 410, and it stays registered."""
    d = deploy(target="tests.e2e.slow_env:SlowCounterEnv")
    episodes = make_episodes(12, seed=43)

    async def main():
        async with client_session() as client:
            cookies = {}
            for episode in episodes:
                body = {
                    "resources_session_id": episode.session_id,
                    "session_key": episode.session_key,
                    "options": {"initial_count": episode.initial, "step_seconds": 0},
                }
                async with client.post(d.url + "/reset", json=body) as reply:
                    assert reply.status == 200
                    cookies[episode.session_id] = reply.cookies["gym_session"].value
            owners = {e.session_id: d.holder(e.session_id) for e in episodes}
            busy_worker = next(w for w in owners.values() if list(owners.values()).count(w) > 1)
            slow, other = [e for e in episodes if owners[e.session_id] == busy_worker][:2]
            # Make one session's steps slow: restart it with step_seconds 12, by its key.
            body = {
                "resources_session_id": slow.session_id,
                "session_key": slow.session_key,
                "options": {"initial_count": 0, "step_seconds": 12},
            }
            async with client.post(d.url + "/reset", json=body) as reply:
                assert reply.status == 200

            async def step(episode: Episode) -> int:
                headers = {"Cookie": f"gym_session={cookies[episode.session_id]}"}
                async with client.post(
                    d.url + "/step", json={"action": 1}, headers=headers
                ) as reply:
                    return reply.status

            blocking = asyncio.ensure_future(step(slow))
            registered = []
            for _ in range(22):  # 11 s: past the registration's 10 s lifetime
                await asyncio.sleep(0.5)
                registered.append(busy_worker in d.registered_workers())
            waiting = await step(other)  # answered once the long step is done
            return await blocking, waiting, registered

    slow_status, other_status, registered = asyncio.run(main())
    assert (slow_status, other_status) == (200, 200)
    assert all(registered)


def test_claims_deleted_under_load_never_split_a_session(deploy):
    """A stray DEL (or an eviction) of live claims while 150 episodes run through nginx:
    every claim is written back for its holder; no episode sees a second env."""
    d = deploy()
    episodes = make_episodes(150, seed=44)
    stop = threading.Event()
    deleted = [0]

    def delete_claims() -> None:
        client = redis.Redis.from_url(d.redis.url, decode_responses=True)
        try:
            while not stop.wait(0.05):
                keys = list(client.scan_iter(match=RedisClaimStore.claim_prefix + "*", count=500))
                for key in keys[::3]:
                    deleted[0] += client.delete(key)
        finally:
            client.close()

    vandal = threading.Thread(target=delete_claims)
    vandal.start()
    try:
        played = asyncio.run(play_all(d.url, episodes))
    finally:
        stop.set()
        vandal.join(10)
    assert deleted[0] > 50
    assert [e.reward for e in played] == [1.0] * len(played), [
        (e.statuses, e.error_codes) for e in played if e.reward != 1.0
    ][:5]
    # Never a second env: no session was ever unknown or gone to its client.
    codes = {code for e in played for code in e.error_codes}
    assert not codes & {"no_open_episode", "session_gone", "session_conflict"}, codes


def test_killing_one_host_its_durable_sessions_continue_on_the_other(deploy):
    d = deploy("--durable-sessions")
    episodes = make_episodes(80, seed=17)

    async def scenario() -> tuple[DurablePlayer, dict[str, str | None], dict[str, int]]:
        async with client_session() as client:
            player = DurablePlayer(client, d.url)
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            owners = {e.session_id: d.holder(e.session_id) for e in episodes}
            host_of = {owner: d.host_of(owner) for owner in set(owners.values()) if owner}
            total = sum(len(e.increments) for e in episodes)

            async def kill_host_zero() -> None:
                while player.steps_done < total // 3:  # noqa: ASYNC110 (a count, not an event)
                    await asyncio.sleep(0.005)
                # The whole host at once: its supervisor first (it would start
                # replacements), then its workers before they see it gone.
                workers = d.hosts[0].worker_pids()
                d.hosts[0].process.kill()
                for pid in workers:
                    os.kill(pid, signal.SIGKILL)
                player.killed = True

            await asyncio.gather(
                kill_host_zero(),
                *[player.finish(e, c) for e, c in zip(episodes, cookies, strict=True)],
            )
            return player, owners, host_of

    player, owners, host_of = asyncio.run(scenario())
    # A wrong count names its episode, failed requests, holder and host: it
    # meant a step ran twice across the kill (a hop's late first send, or a
    # pooled hop's resend taken for a refusal: both fixed, design §4, §3.10.1).
    wrong = [
        (e.session_id, e.reward, player.failures.get(e.session_id), owners[e.session_id])
        for e in episodes
        if e.reward != 1.0
    ]
    assert not wrong, (wrong, {o: host_of.get(o or "") for *_, o in wrong})
    # The dead host's open sessions scored 1.0 above, so they were restored on
    # the other host; their claims are held there (or already ended there:
    # a closed session's claim ends a --window of 2 s after its close).
    moved = [s for s in player.open_at_kill if host_of[owners[s] or ""] == 0]
    assert moved
    live = set(d.hosts[1].worker_pids())
    holders = [d.holder(sid) for sid in moved]
    assert all(h is None or int(h.split("-")[0]) in live for h in holders), holders
    # At most the one request each episode had in flight at the kill failed,
    # with a reset connection or a 502 (never 410: the session was not gone).
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 502), failures
