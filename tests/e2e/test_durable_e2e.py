"""Durable sessions with real ``gym-sessions serve --workers 4 --durable-sessions`` processes."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from envs.counter_load import claim_owner, client_session, make_episodes
from gym_sessions.routing.runtime_dir import RuntimeDirectory

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
    # only a reset connection or 502/410 (the hop broke mid-request).
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 410, 502), failures
    # The victim's sessions open at the kill were taken over (their claims,
    # kept a window after the close, name the worker that restored them).
    taken_over = {s for s in player.open_at_kill if owners[s] == victim}
    assert taken_over
    assert not [s for s in taken_over if claim_owner(runtime_dir, s) in (victim, None)]
    # Every session is closed: its snapshot went with it.
    assert RuntimeDirectory(runtime_dir).snapshot_count() == 0
    assert server.stop() == 0


def test_a_draining_worker_hands_its_open_durable_sessions_over_at_once(serve):
    # SIGTTOU drains one worker. Without durability it serves its open sessions
    # until they close (or --drain-timeout); with it, it leaves as soon as each
    # has its snapshot, and the sessions continue on the other workers.
    server = serve(COUNTER, "--durable-sessions", workers=4)
    episodes = make_episodes(80, seed=18)

    async def scenario() -> tuple[DurablePlayer, float | None]:
        async with client_session() as client:
            player = DurablePlayer(client, server.url)
            before = set(server.worker_pids())
            cookies = await asyncio.gather(*[player.start(e) for e in episodes])
            server.process.send_signal(signal.SIGTTOU)
            drained_after: float | None = None
            started = time.monotonic()

            async def watch() -> None:
                nonlocal drained_after
                while drained_after is None and time.monotonic() - started < 30:
                    if len(before & set(server.worker_pids())) == 3:
                        drained_after = time.monotonic() - started
                    await asyncio.sleep(0.05)

            async def finish_slowly(e, cookie) -> None:
                await asyncio.sleep(1.0)  # sessions stay open well past the drain
                await player.finish(e, cookie)

            await asyncio.gather(
                watch(), *[finish_slowly(e, c) for e, c in zip(episodes, cookies, strict=True)]
            )
            return player, drained_after

    player, drained_after = asyncio.run(scenario())
    assert [e.reward for e in episodes].count(1.0) == len(episodes)
    # The drained worker left within seconds, its sessions still open then.
    assert drained_after is not None and drained_after < 10, drained_after
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

            async def watch() -> None:
                nonlocal gone_after
                while gone_after is None and time.monotonic() - started < 60:
                    if not old & set(server.worker_pids()):
                        gone_after = time.monotonic() - started
                    await asyncio.sleep(0.05)

            async def finish_slowly(e, cookie) -> None:
                for _ in range(100):  # until the reload is under way
                    if gone_after is not None:
                        break
                    await asyncio.sleep(0.1)
                await player.finish(e, cookie)

            await asyncio.gather(
                watch(), *[finish_slowly(e, c) for e, c in zip(episodes, cookies, strict=True)]
            )
            return player, old, gone_after

    player, old, gone_after = asyncio.run(scenario())
    assert gone_after is not None  # the old generation left with its sessions open
    assert [e.reward for e in episodes].count(1.0) == len(episodes)
    assert not old & set(server.worker_pids()) and len(server.worker_pids()) == 2
    for failures in player.failures.values():
        assert len(failures) == 1 and failures[0][1] in (LOST, 410, 502), failures
    print(f"\nold workers gone {gone_after:.1f} s after SIGHUP; failures {player.failures}")
