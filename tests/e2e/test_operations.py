"""Signals and restarts lose nothing, with real supervisors and 4 workers (README "Operations")."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import textwrap
import time

import pytest

from envs.counter_load import Episode, _post, client_session, make_episodes
from gym_sessions.server.process import start_server
from tests.polling import wait_for as _wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # signals and reloads

COUNTER = "envs.counter:CounterEnv"
SLOW = "tests.e2e.slow_env:SlowCounterEnv"


def _caught_signals(pid: int) -> set[signal.Signals]:
    """The signals process ``pid`` has a handler for (``SigCgt`` in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        mask = int(next(line for line in status if line.startswith("SigCgt:")).split()[1], 16)
    known = {int(s) for s in signal.Signals}
    return {signal.Signals(n) for n in known if mask >> (n - 1) & 1}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _start(client, url: str, episode: Episode, **options) -> str | None:
    body = {
        "resources_session_id": episode.session_id,
        "session_key": episode.session_key,
        "options": {
            "initial_count": episode.initial,
            "expected_count": episode.expected,
            **options,
        },
    }
    status, _, cookie = await _post(client, url + "/reset", episode, body, None)
    return cookie if status == 200 else None


async def _finish(client, url: str, episode: Episode, cookie: str | None, pause: float) -> None:
    """Step every increment (``pause`` apart), verify, close: each request on a new connection."""
    for step in episode.increments:
        await asyncio.sleep(pause)
        _, _, cookie = await _post(client, url + "/step", episode, {"action": step}, cookie)
    status, data, cookie = await _post(
        client, url + "/verify", episode, {}, cookie, {"x-gym-close-follows": "1"}
    )
    if status == 200:
        episode.reward = data["reward"]
    names = {"resources_session_id": episode.session_id, "session_key": episode.session_key}
    await _post(client, url + "/close_session", episode, names, cookie)


# SIGTERM / SIGINT ----------------------------------------------------------------------------


def test_sigterm_lets_every_received_request_finish_forwarded_ones_included(serve):
    server = serve(SLOW, "--debug-worker-header", workers=4)
    episodes = make_episodes(8, seed=31)

    async def main():
        async with client_session() as client:
            cookies = [await _start(client, server.url, e, step_seconds=2.0) for e in episodes]

            async def slow_step(episode: Episode, cookie: str) -> tuple[int, dict, bool]:
                headers = {"Cookie": f"gym_session={cookie}"}
                body = {"action": episode.increments[0]}
                async with client.post(server.url + "/step", json=body, headers=headers) as r:
                    return r.status, await r.json(), "x-gym-forwarded-by" in r.headers

            steps = [
                asyncio.ensure_future(slow_step(e, c))
                for e, c in zip(episodes, cookies, strict=True)
            ]
            await asyncio.sleep(0.5)  # every step is in flight (sleeping in its worker)
            server.process.send_signal(signal.SIGTERM)
            return await asyncio.gather(*steps)

    replies = asyncio.run(main())
    assert [status for status, _, _ in replies] == [200] * len(episodes), replies
    for (_, data, _), episode in zip(replies, episodes, strict=True):
        assert data["observation"] == episode.initial + episode.increments[0]
    assert any(forwarded for _, _, forwarded in replies)  # the hop case was exercised
    assert server.process.wait(30) == 0
    assert server.runtime_dirs() == []


def test_a_second_sigint_stops_at_once(serve):
    server = serve(SLOW, workers=4)
    episode = make_episodes(1, seed=32)[0]
    pids = server.worker_pids()

    async def main():
        async with client_session() as client:
            cookie = await _start(client, server.url, episode, step_seconds=20.0)
            headers = {"Cookie": f"gym_session={cookie}"}
            step = asyncio.ensure_future(
                client.post(server.url + "/step", json={"action": 1}, headers=headers)
            )
            await asyncio.sleep(0.5)
            server.process.send_signal(signal.SIGINT)
            await asyncio.sleep(1.0)
            assert server.process.poll() is None  # the first SIGINT waits for the 20 s step
            began = time.monotonic()
            server.process.send_signal(signal.SIGINT)
            await asyncio.to_thread(server.process.wait, 10)
            step.cancel()
            return time.monotonic() - began

    assert asyncio.run(main()) < 5
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), within=5)
    assert server.runtime_dirs() == []


# SIGHUP: zero-downtime reload --------------------------------------------------------------


def test_reload_under_load_loses_no_episode_and_new_code_serves_new_sessions(tmp_path, short_tmp):
    module = tmp_path / "reloadable_env.py"
    source = textwrap.dedent(
        """
        from envs.counter import CounterEnv

        VERSION = {version}

        class Env(CounterEnv):
            def reset(self, *, seed=None, options=None):
                observation, info = super().reset(seed=seed, options=options)
                return observation, {{**info, "version": VERSION}}
        """
    )
    module.write_text(source.format(version=1))
    pid_file = os.path.join(short_tmp, "pid")
    server = start_server(
        "reloadable_env:Env",
        "--pid-file",
        pid_file,
        workers=4,
        tmpdir=os.path.join(short_tmp, "s"),
        env={"PYTHONPATH": f"{tmp_path}:{os.getcwd()}"},
    )
    try:
        old_pids = server.worker_pids()
        episodes = make_episodes(200, seed=33)
        versions: dict[str, int] = {}
        reloaded = asyncio.Event()

        def only_new_workers_answer() -> bool:
            # Ten new connections in a row accepted by new workers: the old ones
            # have closed their copies of the listening socket.
            for _ in range(10):
                worker = server.health()["worker"]
                if int(worker.split("-", 1)[0]) in old_pids:
                    return False
            return True

        async def one(client, index: int, episode: Episode) -> None:
            # Starts spread over 8 s, the reload at 2 s. The last 50 also wait
            # until the new generation took over, however long it takes to
            # start on a loaded machine (a fixed 4 s once was not enough).
            await asyncio.sleep(index * 0.04)
            if index >= 150:
                await reloaded.wait()
            body = {
                "resources_session_id": episode.session_id,
                "session_key": episode.session_key,
                "options": {"initial_count": episode.initial, "expected_count": episode.expected},
            }
            status, data, cookie = await _post(client, server.url + "/reset", episode, body, None)
            if status == 200:
                versions[episode.session_id] = data["info"]["version"]
                await _finish(client, server.url, episode, cookie, pause=0.2)

        async def reload() -> None:
            await asyncio.sleep(2.0)
            # A different size too: a .pyc of the same second and size would pass as fresh.
            module.write_text(source.format(version=2) + "# reloaded\n")
            from gym_sessions.cli import main

            assert main(["reload", "--pid-file", pid_file]) == 0
            took_over = await asyncio.to_thread(_wait_for, only_new_workers_answer, 60, 0.2)
            assert took_over, (
                "the new workers did not take over within 60 s:\n" + server.log()[-3000:]
            )
            reloaded.set()

        async def run() -> None:
            async with client_session() as client:
                await asyncio.gather(reload(), *[one(client, i, e) for i, e in enumerate(episodes)])

        asyncio.run(run())
        assert [e.reward for e in episodes] == [1.0] * 200
        assert {s for e in episodes for s in e.statuses} == {200}
        # Sessions started before the reload ran the old code, later ones the new.
        assert set(versions.values()) == {1, 2}
        assert [versions[e.session_id] for e in episodes[:50]] == [1] * 50
        assert [versions[e.session_id] for e in episodes[-50:]] == [2] * 50
        # The old workers drained out; four new ones serve.
        assert _wait_for(lambda: not any(_alive(pid) for pid in old_pids), within=20)
        new_pids = server.worker_pids()
        assert len(new_pids) == 4 and not set(new_pids) & set(old_pids)
    finally:
        server.stop()


def test_a_reload_whose_workers_start_too_slowly_keeps_the_current_ones(tmp_path, short_tmp):
    module = tmp_path / "slow_import_env.py"
    module.write_text("from envs.counter import CounterEnv as Env\n")
    pid_file = os.path.join(short_tmp, "pid")
    server = start_server(
        "slow_import_env:Env",
        "--pid-file",
        pid_file,
        "--worker-start-timeout",
        "1",
        workers=2,
        tmpdir=os.path.join(short_tmp, "s"),
        env={"PYTHONPATH": f"{tmp_path}:{os.getcwd()}"},
    )
    try:
        old_pids = server.worker_pids()
        # The new code takes 30 s to import: the reload is given up after 1 s.
        module.write_text(
            "import time\ntime.sleep(30)\nfrom envs.counter import CounterEnv as Env\n"
        )
        from gym_sessions.cli import main

        assert main(["reload", "--pid-file", pid_file]) == 0
        assert _wait_for(lambda: "were not serving within 1 s" in server.log(), within=30)
        # The slow new workers were killed; the current ones never drained.
        assert _wait_for(lambda: sorted(server.worker_pids()) == sorted(old_pids), within=10)
        assert int(server.health()["worker"].split("-", 1)[0]) in old_pids
    finally:
        server.stop()


def test_sigttou_drains_one_worker_and_sigttin_adds_one(serve):
    server = serve(COUNTER, workers=4)
    episodes = make_episodes(40, seed=34)

    async def main():
        async with client_session() as client:
            cookies = [await _start(client, server.url, e) for e in episodes]
            server.process.send_signal(signal.SIGTTOU)
            await asyncio.sleep(0.5)
            await asyncio.gather(
                *[
                    _finish(client, server.url, e, c, pause=0.05)
                    for e, c in zip(episodes, cookies, strict=True)
                ]
            )

    asyncio.run(main())
    assert [e.reward for e in episodes] == [1.0] * 40  # the drained worker's sessions too
    assert {s for e in episodes for s in e.statuses} == {200}
    assert _wait_for(lambda: len(server.worker_pids()) == 3, within=20)
    server.process.send_signal(signal.SIGTTIN)
    assert _wait_for(lambda: len(server.worker_pids()) == 4, within=20)
    # Workers (forked from the supervisor) catch none of the supervisor's own signals: a
    # SIGHUP to a worker ends it as it would a spawned one. SIGTERM and SIGINT are uvicorn's.
    supervisors = {signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGQUIT, signal.SIGWINCH}
    assert supervisors <= _caught_signals(server.process.pid)
    for pid in server.worker_pids():
        # A worker just forked still has them (with every signal blocked) until it resets.
        assert _wait_for(lambda pid=pid: not _caught_signals(pid) & supervisors, within=20), pid
        assert _wait_for(lambda pid=pid: signal.SIGTERM in _caught_signals(pid), within=20), pid


# No orphans ------------------------------------------------------------------------------------


def test_killed_supervisor_takes_its_workers_and_the_port_is_free_again(serve, short_tmp):
    server = serve(COUNTER, workers=4)
    pids = server.worker_pids()
    (runtime_dir,) = server.runtime_dirs()
    port = int(server.url.rsplit(":", 1)[1])
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(5)
    began = time.monotonic()
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), within=5)
    assert time.monotonic() - began < 3  # the bound is 2 s; a loaded machine adds some
    assert os.path.isdir(runtime_dir)  # nobody removed it: the supervisor was killed
    # A new server on the same port, in the same temporary directory, starts at once
    # and removes the directory the dead one left.
    again = start_server(COUNTER, "--port", str(port), workers=2, tmpdir=server.tmpdir)
    try:
        assert again.url.endswith(f":{port}")
        assert not os.path.exists(runtime_dir)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        again.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the REPL sandbox needs root (see README)")
@pytest.mark.xdist_group("repl_sandbox")  # the sandbox's uid range is host-wide
def test_a_sessions_processes_die_with_its_killed_supervisor(serve):
    server = serve("envs.python_repl:PythonReplServer", workers=4)
    code = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "print(p.pid)"
    )

    async def main() -> int:
        async with (
            client_session() as client,
            client.post(server.url + "/run_code", json={"code": code}) as reply,
        ):
            assert reply.status == 200, await reply.text()
            return int((await reply.json())["stdout"])

    sleeper = asyncio.run(main())
    assert _alive(sleeper)
    workers = server.worker_pids()
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(5)
    # Workers exit (releasing their sessions), and each session's processes with them.
    assert _wait_for(lambda: not any(_alive(pid) for pid in workers), within=5), server.log()
    assert _wait_for(lambda: not _alive(sleeper), within=5), _described(sleeper) + server.log()


def _described(pid: int) -> str:
    """The fields of ``/proc/PID/status`` that say who a process is and who holds it."""
    try:
        with open(f"/proc/{pid}/status") as status:
            lines = [line for line in status if line.split(":")[0] in ("State", "PPid", "Uid")]
    except FileNotFoundError:
        return f"{pid}: gone\n"
    return f"{pid}: " + " ".join(line.strip() for line in lines) + "\n"
