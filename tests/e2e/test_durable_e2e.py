"""Durable sessions with real ``gym-sessions serve --workers 4 --durable-sessions`` processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from envs.counter_load import client_session, make_episodes
from gym_sessions import RemoteEnv
from gym_sessions.client.step_recovery import OBSERVE_REQUEST
from gym_sessions.metrics.status import parse_samples
from gym_sessions.runtime_dir import RuntimeDirectory
from tests.services import claim_owner

from .durable_player import LOST, DurablePlayer

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
EPISODES = 200


def test_sigkilled_worker_mid_episodes_loses_no_durable_session(serve):
    server = serve(COUNTER, "--durable-sessions", workers=4)
    (runtime_dir,) = server.runtime_dirs()
    episodes = make_episodes(EPISODES, seed=16)

    async def scenario() -> tuple[DurablePlayer, dict[str, str | None], str]:
        async with client_session() as client:
            player = DurablePlayer(client, server.url)
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            owners = {e.session_id: claim_owner(runtime_dir, e.session_id) for e in episodes}
            victim = max(set(owners.values()), key=list(owners.values()).count)
            assert victim is not None
            total = sum(len(e.increments) for e in episodes)

            async def kill_midway() -> None:
                while player.steps_done < total // 3:  # noqa: ASYNC110 (a count, not an event)
                    await asyncio.sleep(0.005)
                os.kill(int(victim.split("-")[0]), signal.SIGKILL)
                player.killed = True

            await asyncio.gather(
                kill_midway(),
                *[player.finish(e, c) for e, c in zip(episodes, cookies, strict=True)],
            )
            return player, owners, victim

    player, owners, victim = asyncio.run(scenario())
    assert [e.reward for e in episodes].count(1.0) == EPISODES
    assert any(owner == victim for owner in owners.values())
    # Failures only where a request was in flight on the victim at the kill
    # (each episode has one request at a time): at most one per episode, and
    # only a reset connection or 502 (the hop broke mid-request: never 410,
    # the session was not gone).
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 502), failures
    # The victim's sessions open at the kill were taken over (their claims,
    # kept a window after the close, name the worker that restored them).
    taken_over = {s for s in player.open_at_kill if owners[s] == victim}
    assert taken_over
    assert not [s for s in taken_over if claim_owner(runtime_dir, s) in (victim, None)]
    # Every session is closed: its snapshot went with it.
    assert RuntimeDirectory(runtime_dir).snapshot_count() == 0
    # /metrics counts the restores: each session open at the kill at least,
    # at most every session the victim held (one whose close was in flight at
    # the kill is restored for its resent close), and the snapshots written
    # (the killed worker's included: its counters outlive it).
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as reply:
        page = parse_samples(reply.read().decode())
    totals = {
        name: sum(s.value for s in page if s.name == name)
        for name in ("gym_sessions_restored_sessions_total", "gym_sessions_snapshots_written_total")
    }
    victims_sessions = sum(1 for owner in owners.values() if owner == victim)
    assert len(taken_over) <= totals["gym_sessions_restored_sessions_total"] <= victims_sessions
    assert totals["gym_sessions_snapshots_written_total"] >= EPISODES
    assert server.stop() == 0


def test_a_draining_worker_hands_its_open_durable_sessions_over_at_once(serve):
    # SIGTTOU drains one worker. Without durability it serves its open sessions
    # until they close (or --drain-timeout); with it, it leaves as soon as each
    # has its snapshot, and the sessions continue on the other workers.
    server = serve(COUNTER, "--durable-sessions", workers=4)
    episodes = make_episodes(80, seed=18)

    async def scenario() -> tuple[DurablePlayer, float | None, bool]:
        async with client_session() as client:
            player = DurablePlayer(client, server.url)
            before = set(server.worker_pids())
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            server.process.send_signal(signal.SIGTTOU)
            drained_after: float | None = None
            finished = 0
            open_when_drained = False
            watched = asyncio.Event()
            started = time.monotonic()

            async def watch() -> None:
                nonlocal drained_after, open_when_drained
                while drained_after is None and time.monotonic() - started < 30:
                    if len(before & set(server.worker_pids())) == 3:
                        drained_after = time.monotonic() - started
                        open_when_drained = finished == 0
                    await asyncio.sleep(0.05)
                watched.set()

            async def finish_after_the_drain(e, cookie) -> None:
                nonlocal finished
                # Open until the worker left (or the watch gave up): a drain that
                # waited for its sessions to close would never see it leave.
                await watched.wait()
                await player.finish(e, cookie)
                finished += 1

            await asyncio.gather(
                watch(),
                *[finish_after_the_drain(e, c) for e, c in zip(episodes, cookies, strict=True)],
            )
            return player, drained_after, open_when_drained

    player, drained_after, open_when_drained = asyncio.run(scenario())
    assert [e.reward for e in episodes].count(1.0) == len(episodes)
    # The drained worker left while every session was still open.
    assert drained_after is not None and open_when_drained, drained_after
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 410, 502), failures
    print(f"\ndrained worker gone after {drained_after:.1f} s; failures {player.failures}")


def test_a_reload_hands_open_durable_sessions_to_the_new_workers(serve):
    # SIGHUP: once the new generation serves, the old workers drain; with
    # durable sessions they leave at once and their open sessions continue
    # on the new workers (the same target, imported afresh).
    server = serve(COUNTER, "--durable-sessions", workers=2)
    episodes = make_episodes(40, seed=19)

    async def scenario() -> tuple[DurablePlayer, set[int], float | None]:
        async with client_session() as client:
            player = DurablePlayer(client, server.url)
            old = set(server.worker_pids())
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            server.process.send_signal(signal.SIGHUP)
            started = time.monotonic()
            gone_after: float | None = None
            watched = asyncio.Event()

            async def watch() -> None:
                nonlocal gone_after
                while gone_after is None and time.monotonic() - started < 60:
                    if not old & set(server.worker_pids()):
                        gone_after = time.monotonic() - started
                    await asyncio.sleep(0.05)
                watched.set()

            async def finish_after_the_reload(e, cookie) -> None:
                # Open until the old generation left (or the watch gave up): one
                # that waited for its sessions to close would never be seen leaving.
                await watched.wait()
                await player.finish(e, cookie)

            await asyncio.gather(
                watch(),
                *[finish_after_the_reload(e, c) for e, c in zip(episodes, cookies, strict=True)],
            )
            return player, old, gone_after

    player, old, gone_after = asyncio.run(scenario())
    assert gone_after is not None  # the old generation left with its sessions open
    assert [e.reward for e in episodes].count(1.0) == len(episodes)
    assert not old & set(server.worker_pids()) and len(server.worker_pids()) == 2
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 410, 502), failures
    print(f"\nold workers gone {gone_after:.1f} s after SIGHUP; failures {player.failures}")


def _kill_holder_of(runtime_dir: str, session_id: str) -> str:
    holder = claim_owner(runtime_dir, session_id)
    assert holder is not None
    os.kill(int(holder.split("-")[0]), signal.SIGKILL)
    time.sleep(0.3)  # reaped by the supervisor: its socket refuses
    return holder


def _post(url: str, path: str, body: dict, cookie: str | None = None) -> tuple[int, dict, str]:
    request = urllib.request.Request(
        url + path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **({"Cookie": cookie} if cookie else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            set_cookie = reply.headers.get("set-cookie") or ""
            return reply.status, json.loads(reply.read()), set_cookie.split(";", 1)[0]
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), ""


def test_a_seeded_cartpole_episode_restored_midway_matches_an_uninterrupted_run(serve):
    server = serve("CartPole-v1", "--durable-sessions", workers=4)
    (runtime_dir,) = server.runtime_dirs()

    def episode(kill_at: int | None) -> list[list[float]]:
        sid = uuid.uuid4().hex
        status, data, cookie = _post(
            server.url, "/reset", {"resources_session_id": sid, "seed": 123}
        )
        assert status == 200, data
        observations = [data["observation"]]
        for index in range(200):
            if index == kill_at:
                _kill_holder_of(runtime_dir, sid)
            status, data, _ = _post(server.url, "/step", {"action": index % 2}, cookie)
            assert status == 200, data  # the step after the kill too: restored, no error
            observations.append(data["observation"])
            if data["terminated"] or data["truncated"]:
                break
        # The env's RNG came along: an unseeded reset draws the same start.
        status, data, _ = _post(server.url, "/reset", {}, cookie)
        observations.append(data["observation"])
        return observations

    uninterrupted = episode(None)
    assert len(uninterrupted) > 8
    assert episode(5) == uninterrupted


def test_a_step_batch_restores_the_sessions_of_a_sigkilled_holder(serve):
    # Each entry follows the rule of its own /step: no 410 where a /step restores.
    server = serve(COUNTER, "--durable-sessions", workers=4)
    (runtime_dir,) = server.runtime_dirs()
    cookies: dict[str, str] = {}
    for k in range(12):  # new connections: on several workers
        sid = uuid.uuid4().hex
        options = {"initial_count": 10 * k}
        status, data, cookie = _post(
            server.url, "/reset", {"resources_session_id": sid, "options": options}
        )
        assert status == 200, data
        cookies[sid] = cookie.partition("=")[2]
    entries = [{"cookie": cookie, "action": 1} for cookie in cookies.values()]
    status, first, _ = _post(server.url, "/step_batch", {"entries": entries})
    assert status == 200 and [r["observation"] for r in first["results"]] == [
        10 * k + 1 for k in range(12)
    ]
    victim = _kill_holder_of(runtime_dir, next(iter(cookies)))
    killed = [sid for sid in cookies if claim_owner(runtime_dir, sid) == victim]
    status, second, _ = _post(server.url, "/step_batch", {"entries": entries})
    assert status == 200
    results = second["results"]
    assert [r.get("observation") for r in results] == [10 * k + 2 for k in range(12)], results
    assert all(claim_owner(runtime_dir, sid) not in (None, victim) for sid in killed)
    assert victim not in {r["worker"] for r in results}


def test_an_env_that_cannot_be_captured_still_gets_410(serve):
    server = serve("tests.e2e.uncapturable_env:LockedCounterEnv", "--durable-sessions", workers=2)
    assert "sessions cannot be captured" in server.log()  # said once, at start-up
    (runtime_dir,) = server.runtime_dirs()
    sid = uuid.uuid4().hex
    status, _, cookie = _post(server.url, "/reset", {"resources_session_id": sid})
    assert status == 200
    assert _post(server.url, "/step", {"action": 1}, cookie)[0] == 200
    assert RuntimeDirectory(runtime_dir).snapshot_count() == 0
    _kill_holder_of(runtime_dir, sid)
    status, data, _ = _post(server.url, "/step", {"action": 1}, cookie)
    assert status == 410 and data["error"]["code"] == "session_gone"


def test_a_restored_session_still_answers_nemo_seed_retries_as_before(serve):
    # NeMo Gym's contract (test_nemo_contract.py): a repeated /seed_session of an
    # open session replays its first reply, another episode gets 409. Its start
    # record and episode binding travel in the snapshot, so a restore keeps both.
    server = serve(COUNTER, "--durable-sessions", "--trust-session-ids", workers=4)
    (runtime_dir,) = server.runtime_dirs()
    sid = f"nemo-durable-{uuid.uuid4().hex}"
    seed = {
        "resources_session_id": sid,
        "episode_id": {"rollout_id": "r", "attempt": 0},
        "task_id": {"taskset": "counter", "task_id": "0"},
        "task_data": {"goal": 7},
    }
    status, first, cookie = _post(server.url, "/seed_session", seed)
    assert status == 200, first
    status, data, _ = _post(server.url, "/step", {"action": 2}, cookie)
    assert status == 200, data
    _kill_holder_of(runtime_dir, sid)
    status, replayed, _ = _post(server.url, "/seed_session", seed)
    assert (status, replayed) == (200, first)  # replayed, not restarted
    status, data, _ = _post(server.url, "/observe", {}, cookie)
    assert status == 200 and data["episode_length"] == 1, data  # the step survived
    other = {**seed, "episode_id": {"rollout_id": "other", "attempt": 0}}
    status, data, _ = _post(server.url, "/seed_session", other)
    assert (status, data["error"]["code"]) == (409, "session_conflict")


@pytest.mark.parametrize("connection_on", ["another_worker", "the_holder"])
def test_a_remote_env_steps_on_when_its_holder_is_killed_mid_step(serve, short_tmp, connection_on):
    # The library's own client, not a test player: a step in flight when the
    # holder is SIGKILLed returns as if nothing happened (restored elsewhere,
    # run once). Over another worker the hop breaks (502: the session is not
    # gone); on the holder the connection itself does (lost).
    server = serve(
        "tests.e2e.slow_env:SlowCounterEnv",
        *("--durable-sessions", "--handoff", "off", "--debug-worker-header"),
        workers=2,
    )
    marker = os.path.join(short_tmp, "stepping")
    env = RemoteEnv(server.url)
    try:
        options = {"initial_count": 0, "expected_count": 3, "step_seconds": 1.0}
        env.reset(options={**options, "step_marker": marker})
        env.step(1)
        holder = env.worker
        assert holder is not None
        # A new connection lands on either worker: take one on the wanted side.
        for _ in range(100):
            env._http.close()
            reply = env._http.send(OBSERVE_REQUEST)
            if ("x-gym-forwarded-by" in reply.headers) == (connection_on == "another_worker"):
                break
        else:
            pytest.fail(f"no connection landed on {connection_on}")
        os.unlink(marker)
        with ThreadPoolExecutor(1) as pool:
            step = pool.submit(env.step, 1)
            deadline = time.monotonic() + 30
            while not os.path.exists(marker) and time.monotonic() < deadline:
                time.sleep(0.01)  # the holder is in env.step (it sleeps 1 s)
            os.kill(int(holder.split("-")[0]), signal.SIGKILL)
            observation, *_ = step.result(timeout=60)
        assert observation == 2  # run once, on the session as the client last saw it
        assert env.step(1)[0] == 3
        assert env.verify()["reward"] == 1.0
    finally:
        env.close()
    assert server.stop() == 0
