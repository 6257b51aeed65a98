"""`run_episodes` records, and the clients' timeouts and retries through a faulty proxy."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import (
    AsyncRemoteEnv,
    ConnectionLostError,
    RemoteEnv,
    RemoteVectorEnv,
    ReplyTimeoutError,
    run_episodes,
)
from gym_sessions.errors import ServerUnreachableError
from gym_sessions.server.process import start_server

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"
FIELDS = {
    "episode",
    "step",
    "env_index",
    "worker",
    "observation",
    "action",
    "reward",
    "terminated",
    "truncated",
}


def lean(observation: np.ndarray) -> int:
    """Push the cart the way the pole leans."""
    return int(observation[2] > 0)


@pytest.fixture(scope="module")
def cartpole():
    with start_server("CartPole-v1", workers=4) as server:
        yield server


@pytest.fixture(scope="module")
def counter():
    with start_server("envs.counter:CounterEnv") as server:
        yield server


def by_episode(records: list[dict]) -> dict[int, list[dict]]:
    episodes: dict[int, list[dict]] = defaultdict(list)
    for record in records:
        episodes[record["episode"]].append(record)
    return episodes


def test_records_of_twelve_episodes_on_four_workers(cartpole):
    records = run_episodes(cartpole.url, lean, episodes=12, num_envs=4, seed=0, progress=False)
    episodes = by_episode(records)
    assert sorted(episodes) == list(range(12))
    for steps in episodes.values():
        assert [r["step"] for r in steps] == list(range(len(steps)))
        assert set(steps[0]) == FIELDS
        *middle, last = steps
        assert last["terminated"] or last["truncated"]
        assert not any(r["terminated"] or r["truncated"] for r in middle)
        assert len({(r["env_index"], r["worker"]) for r in steps}) == 1
        assert all(r["reward"] == 1.0 for r in steps)
    # Workers are the server's own: the pids of its worker processes.
    claimants = set()
    for path in cartpole.claim_files():
        with open(path) as file:
            claimants.add(file.read().strip())
    workers = {r["worker"] for r in records}
    assert workers <= claimants, (workers, claimants)
    for worker in workers:
        os.kill(int(worker.split("-")[0]), 0)  # a live process

    # The same run on a local SyncVectorEnv gives the same trajectories.
    local = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    expected = run_episodes(local, lean, episodes=12, seed=0, progress=False)
    local.close()
    assert len(expected) == len(records)
    for got, want in zip(records, expected, strict=True):
        assert got["worker"] and want["worker"] is None
        np.testing.assert_array_equal(got["observation"], want["observation"])
        assert {k: got[k] for k in FIELDS - {"worker", "observation"}} == {
            k: want[k] for k in FIELDS - {"worker", "observation"}
        }


class Agent:
    def __init__(self) -> None:
        self.infos: list[dict] = []

    def act(self, observation: np.ndarray, info: dict) -> int:
        self.infos.append(info)
        return lean(observation)


@pytest.mark.parametrize("mode", [AutoresetMode.SAME_STEP, AutoresetMode.DISABLED])
def test_every_autoreset_mode_gives_the_same_episodes(cartpole, mode):
    def episodes_per_env(records: list[dict]) -> dict[int, list[list[float]]]:
        runs: dict[int, list[list[float]]] = defaultdict(list)
        for steps in by_episode(records).values():
            runs[steps[0]["env_index"]].append([float(r["observation"][0]) for r in steps])
        return runs

    reference = run_episodes(cartpole.url, lean, episodes=9, num_envs=3, seed=5, progress=False)
    agent = Agent()
    envs = gym.make_vec(REMOTE, num_envs=3, url=cartpole.url, autoreset_mode=mode)
    try:
        records = run_episodes(envs, agent, episodes=9, seed=5, progress=False)
    finally:
        envs.close()
    assert sorted(by_episode(records)) == list(range(9))
    got, want = episodes_per_env(records), episodes_per_env(reference)
    for index, runs in got.items():
        shared = min(len(runs), len(want[index]))
        assert shared >= 1 and runs[:shared] == want[index][:shared]
    assert len(agent.infos) == len(records)  # act() is called for recorded steps only


def test_progress_bar_counts_episodes(counter, capsys):
    records = run_episodes(
        counter.url, lambda obs: 1, episodes=3, num_envs=2, max_episode_steps=4, progress=True
    )
    assert len(records) == 12
    assert [r["observation"] for r in records if r["episode"] == 0] == [0, 1, 2, 3]
    assert "3/3" in capsys.readouterr().err


# Timeouts and retries ------------------------------------------------------------------------


#: A hop behind the server broke (what a worker answers when a holder died mid-request).
BAD_GATEWAY_BODY = b'{"error": {"code": "bad_gateway", "message": "a holder died (proxy)"}}'
BAD_GATEWAY_REPLY = (
    b"HTTP/1.1 502 Bad Gateway\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(BAD_GATEWAY_BODY), BAD_GATEWAY_BODY)
)


class FaultyProxy:
    """A TCP proxy in front of a server that breaks the first request matching ``target``.

    Faults: ``drop_reply`` forwards the request and closes the client's
    connection instead of replying; ``drop_request`` closes it without
    forwarding; ``hold`` forwards nothing and never replies; ``bad_gateway``
    forwards nothing and answers 502 ``bad_gateway``. ``then``: a second
    (target, fault), for the first matching request after that.
    """

    def __init__(
        self, upstream_url: str, target: bytes, fault: str, then: tuple[bytes, str] | None = None
    ) -> None:
        host, port = upstream_url.split("://", 1)[1].rsplit(":", 1)
        self.upstream = (host, int(port))
        self.faults = [(target, fault)] + ([then] if then else [])
        self.seen: list[bytes] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self.loop
        ).result()
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        drop_next_reply = asyncio.Event()

        async def replies() -> None:
            while data := await up_reader.read(65536):
                if drop_next_reply.is_set():
                    writer.close()
                    return
                writer.write(data)
                await writer.drain()
            writer.close()

        pump = asyncio.create_task(replies())
        try:
            while data := await reader.read(65536):
                if data[:4] in (b"GET ", b"POST"):
                    self.seen.append(data.split(b"\r\n", 1)[0])
                if self.faults and data.startswith(self.faults[0][0]):
                    _, fault = self.faults.pop(0)
                    if fault == "drop_request":
                        break
                    if fault == "hold":
                        await asyncio.sleep(3600)
                    if fault == "bad_gateway":
                        writer.write(BAD_GATEWAY_REPLY)
                        await writer.drain()
                        break
                    drop_next_reply.set()
                up_writer.write(data)
                await up_writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()
            up_writer.close()
            pump.cancel()

    def requests(self, prefix: bytes) -> int:
        return sum(line.startswith(prefix) for line in self.seen)

    def close(self) -> None:
        async def shutdown() -> None:
            self.server.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


@pytest.fixture
def proxy(counter) -> Iterator:
    made: list[FaultyProxy] = []

    def make(target: bytes, fault: str, then: tuple[bytes, str] | None = None) -> FaultyProxy:
        made.append(FaultyProxy(counter.url, target, fault, then))
        return made[-1]

    yield make
    for p in made:
        p.close()


def sessions(server) -> int:
    return server.health()["sessions"]


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_retried_reset_makes_one_session(counter, proxy, client):
    faulty = proxy(b"POST /reset", "drop_reply")
    before = sessions(counter)
    if client == "sync":
        env = RemoteEnv(faulty.url)
        env.reset(options={"initial_count": 40})
        assert env.step(2)[0] == 42
        assert sessions(counter) == before + 1
        env.close()
    else:

        async def main() -> None:
            async with AsyncRemoteEnv(faulty.url) as env:
                await env.reset(options={"initial_count": 40})
                assert (await env.step(2))[0] == 42
                assert sessions(counter) == before + 1

        asyncio.run(main())
    assert faulty.requests(b"POST /reset") == 2  # the lost reply was retried once
    assert sessions(counter) == before


async def _async_lost_step(url: str) -> int:
    async with AsyncRemoteEnv(url) as env:
        await env.reset(options={"initial_count": 0})
        with pytest.raises(ConnectionLostError, match="the step ran on the server"):
            await env.step(5)
        return int((await env.step(1))[0])


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_step_whose_reply_is_lost_is_not_sent_again(counter, proxy, client):
    faulty = proxy(b"POST /step", "drop_reply")
    if client == "sync":
        env = RemoteEnv(faulty.url)
        env.reset(options={"initial_count": 0})
        with pytest.raises(ConnectionLostError, match="the step ran on the server"):
            env.step(5)
        count = int(env.step(1)[0])
        env.close()
    else:
        count = asyncio.run(_async_lost_step(faulty.url))
    assert count == 6  # 0 + 5 (ran once, its reply lost) + 1; a blind resend would give 11
    assert faulty.requests(b"POST /step") == 2
    assert faulty.requests(b"POST /observe") == 1


def test_a_step_that_never_reached_the_server_is_sent_again(counter, proxy):
    faulty = proxy(b"POST /step", "drop_request")
    env = RemoteEnv(faulty.url)
    env.reset(options={"initial_count": 0})
    assert env.step(5)[0] == 5  # /observe showed it did not run, so it was resent
    assert env.step(1)[0] == 6
    env.close()
    assert faulty.requests(b"POST /observe") == 1


def test_a_lost_batch_recovers_through_a_502_to_its_observe(counter, proxy):
    # A vector env's batch is lost before it reaches the server; a sub-env's
    # /observe then meets a 502 (a hop to the holder that had just died): it
    # asks once more, finds the step did not run, and sends it again.
    faulty = proxy(b"POST /step_batch", "drop_request", then=(b"POST /observe", "bad_gateway"))
    envs = RemoteVectorEnv(2, faulty.url)
    try:
        envs.reset(options={"initial_count": 0})
        observations, *_ = envs.step(np.array([5, 7]))
        assert observations.tolist() == [5, 7]  # each step ran once
        observations, *_ = envs.step(np.array([1, 1]))
        assert observations.tolist() == [6, 8]
    finally:
        envs.close()
    assert faulty.requests(b"POST /observe") == 3  # one 502, then one per sub-env
    assert faulty.requests(b"POST /step_batch") == 2


def test_a_step_without_reply_times_out_and_is_not_resent(counter, proxy):
    faulty = proxy(b"POST /step", "hold")
    env = RemoteEnv(faulty.url, timeout=0.5)
    env.reset(options={"initial_count": 0})
    with pytest.raises(ReplyTimeoutError, match="POST /step"):
        env.step(5)
    assert faulty.requests(b"POST /step") == 1
    env.close()


def test_unreachable_server_is_named_by_async_and_vector_clients():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ServerUnreachableError, match=url):
        asyncio.run(AsyncRemoteEnv.create(url))
    threads = threading.active_count()
    with pytest.raises(ServerUnreachableError, match=url):
        gym.make_vec(REMOTE, num_envs=4, url=url)
    assert threading.active_count() == threads  # the event loop thread was stopped
