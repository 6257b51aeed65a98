"""Secrets that stay secret, with real ``gym-sessions serve`` processes at 4 workers.

- A secret on the command line (``--secret S``, ``--secret=S``) is refused:
  exit 2 and one line pointing to ``--secret-file`` and ``GYM_SESSIONS_SECRET``.
- ``--secret-file`` is refused unless it is a regular file only its owner can
  read or write, holding one line of at least 32 characters; a shorter
  ``GYM_SESSIONS_SECRET`` is refused too.
- With a 0600 file every worker signs and verifies with that secret (a cookie
  signed with another one names no session), replacements of killed workers too.
- The secret is in no process's command line and in no worker's environment
  (nor in the supervisor's when it came from a file).
- The supervisor and every worker are non-dumpable: a process of the same uid
  without ``CAP_SYS_PTRACE`` reads neither their environment nor their memory,
  though it reads both of a dumpable process of that uid (the control).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from gym_sessions.credentials import SessionCredentials
from gym_sessions.non_dumpable import is_dumpable
from gym_sessions.secret_source import server_secret, write_secret_file
from gym_sessions.server.process import ServerProcess, start_server
from gym_sessions.settings import SECRET_ENV
from tests.services import claim_owner

from .subprocesses import run_module

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
WORKERS = 4
SECRET = "exactly-32-characters-secret-ok!"  # the shortest accepted
assert len(SECRET) == 32
OTHER_SECRET = "another-secret-of-the-same-size!"
EXIT_STARTUP_FAILURE = 2
REFUSAL_TIMEOUT = 30.0  # a server that starts instead of refusing is stopped after this


# ----------------------------------------------------------------------------- helpers


def refusal_line(tmpdir: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run ``serve COUNTER --workers 4 ARGS``; assert it exits 2 with one error line; return it."""
    child_env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    child_env.update(env or {}, TMPDIR=str(tmpdir))
    code, stdout, stderr = run_module(
        "serve", COUNTER, "--port", "0", "--workers", str(WORKERS), *args,
        timeout=REFUSAL_TIMEOUT, cwd=tmpdir, env=child_env,
    )  # fmt: skip
    lines = stderr.strip().splitlines()
    assert code == EXIT_STARTUP_FAILURE, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith("gym-sessions: error: "), stderr
    assert stdout == ""
    assert list(tmpdir.glob("gym-sessions-*")) == []  # refused before any runtime directory
    return lines[0]


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from ``/proc/*/stat``)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as file:
                    parents[int(entry)] = int(file.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, p in parents.items() if p == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def proc_file(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as file:
        return file.read()


def worker_pids(server: ServerProcess) -> set[int]:
    """PIDs of the live workers, from their private sockets (named ``<pid>-...``)."""
    pids = {int(os.path.basename(path).split("-")[0]) for path in server.worker_sockets()}
    return {pid for pid in pids if pid in server.worker_pids()}


def kill_one_worker_and_wait_for_its_replacement(server: ServerProcess) -> int:
    """SIGKILL a worker; the PID of the worker uvicorn starts instead, once it serves."""
    before = worker_pids(server)
    os.kill(min(before), signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        new = worker_pids(server) - before
        if new:  # its private socket exists: it built its app from the config it received
            return new.pop()
        time.sleep(0.1)
    raise AssertionError(f"no replacement worker within 60 s:\n{server.log()}")


@pytest.fixture
def servers(short_tmp) -> Iterator[list[ServerProcess]]:
    """Servers a test starts itself (append them); all stopped at teardown, by PID."""
    started: list[ServerProcess] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request (so requests land on any worker), no cookie jar."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=30),
    ) as session:
        yield session


async def reset(client: aiohttp.ClientSession, url: str, initial: int) -> tuple[str, str]:
    """Start a session; its id and the cookie the server set."""
    body = {"options": {"initial_count": initial}}
    async with client.post(url + "/reset", json=body) as reply:
        assert reply.status == 200, await reply.text()
        return (await reply.json())["resources_session_id"], reply.cookies["gym_session"].value


async def observe(client: aiohttp.ClientSession, url: str, cookie: str) -> tuple[int, object]:
    headers = {"Cookie": f"gym_session={cookie}"}
    async with client.post(url + "/observe", json={}, headers=headers) as reply:
        return reply.status, await reply.json()


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("form", ["separate", "joined"])
def test_a_secret_on_the_command_line_is_refused_with_a_pointer(short_tmp, form):
    args = ("--secret", SECRET) if form == "separate" else (f"--secret={SECRET}",)
    line = refusal_line(Path(short_tmp), *args)
    assert "--secret-file" in line and SECRET_ENV in line
    assert SECRET not in line


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660])
def test_a_secret_file_open_to_group_or_others_is_refused(short_tmp, tmp_path, mode):
    path = tmp_path / "secret"
    write_secret_file(str(path), SECRET)
    path.chmod(mode)
    line = refusal_line(Path(short_tmp), "--secret-file", str(path))
    assert str(path) in line and f"{mode:04o}" in line and "chmod 600" in line
    assert SECRET not in line


def _make_fifo(path: Path) -> None:
    os.mkfifo(path, 0o600)


@pytest.mark.parametrize(
    ("make", "mention"),
    [
        (lambda path: None, "No such file"),
        (lambda path: path.mkdir(mode=0o700), "not a regular file"),
        (_make_fifo, "not a regular file"),  # opening it must not block the start
        (lambda path: write_secret_file(str(path), SECRET[:-1]), "31 characters"),
        (lambda path: write_secret_file(str(path), ""), "0 characters"),
        (lambda path: write_secret_file(str(path), SECRET + "\n" + SECRET), "one line"),
    ],
    ids=["missing", "directory", "fifo", "31-characters", "empty", "two-lines"],
)
def test_a_missing_odd_or_short_secret_file_is_refused(short_tmp, tmp_path, make, mention):
    path = tmp_path / "secret"
    make(path)
    line = refusal_line(Path(short_tmp), "--secret-file", str(path))
    assert str(path) in line and mention in line


def test_a_secret_file_wins_over_the_environment_which_is_emptied_either_way(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    write_secret_file(str(path), SECRET)
    monkeypatch.setenv(SECRET_ENV, OTHER_SECRET)
    assert server_secret(str(path)) == SECRET
    assert SECRET_ENV not in os.environ  # so no process started later inherits it
    monkeypatch.setenv(SECRET_ENV, OTHER_SECRET)
    assert server_secret(None) == OTHER_SECRET
    assert SECRET_ENV not in os.environ
    assert server_secret(None) is None  # neither: Settings picks one at random


def test_a_short_secret_in_the_environment_is_refused(short_tmp):
    line = refusal_line(Path(short_tmp), env={SECRET_ENV: SECRET[:-1]})
    assert SECRET_ENV in line and "31 characters" in line
    assert SECRET[:-1] not in line


# ----------------------------------------------------------------------------- a secret file


async def test_a_private_secret_file_signs_on_every_worker_and_stays_out_of_proc(
    servers, short_tmp, tmp_path, client
):
    secret_path = str(tmp_path / "secret")
    write_secret_file(secret_path, SECRET)
    os.chmod(secret_path, 0o600)
    server = start_server(
        COUNTER, "--secret-file", secret_path, workers=WORKERS, tmpdir=os.path.join(short_tmp, "s")
    )
    servers.append(server)
    (runtime_dir,) = server.runtime_dirs()
    right = SessionCredentials(SECRET, "gym_session")
    wrong = SessionCredentials(OTHER_SECRET, "gym_session")

    async def sessions_on_every_worker(workers: set[int]) -> dict[int, tuple[str, str]]:
        """A session owned by each of ``workers`` (pid -> (id, the cookie its owner set))."""
        owned: dict[int, tuple[str, str]] = {}
        for count in range(200):
            sid, cookie = await reset(client, server.url, count)
            owner = int(claim_owner(runtime_dir, sid).split("-")[0])
            owned.setdefault(owner, (sid, cookie))
            if set(owned) >= workers:
                return owned
        raise AssertionError(f"sessions only on {set(owned)} of {workers}")

    async def check_signing(workers: set[int]) -> None:
        for pid, (sid, cookie) in (await sessions_on_every_worker(workers)).items():
            # The worker signed its cookie with the file's secret ...
            data = right.decode_cookie(cookie)
            assert data is not None and data["session_id"] == sid, pid
            # ... and a cookie signed with it is read, one signed with another is not
            # (each on a new connection, so on any worker).
            signed, forged = (credentials.encode_cookie(data) for credentials in (right, wrong))
            for _ in range(WORKERS):
                status, reply = await observe(client, server.url, signed)
                assert status == 200, reply
                status, reply = await observe(client, server.url, forged)
                assert (status, reply["error"]["code"]) == (404, "no_open_episode")

    def check_proc() -> None:
        processes = descendants(server.process.pid)  # supervisor, workers, resource tracker
        assert worker_pids(server) <= set(processes)
        # Only root reads the environment of a non-dumpable process (see below).
        names = ("cmdline", "environ") if os.getuid() == 0 else ("cmdline",)
        for pid in processes:
            for name in names:
                assert SECRET.encode() not in proc_file(pid, name), (pid, name)

    await check_signing(worker_pids(server))
    check_proc()

    replacement = kill_one_worker_and_wait_for_its_replacement(server)
    await check_signing({replacement})
    check_proc()


# ----------------------------------------------------------------------------- non-dumpable

# Reports, for each PID, whether /proc/<pid>/environ and /proc/<pid>/mem open for reading.
READER = """
import json, sys
result = {}
for pid in sys.argv[1:]:
    for name in ("environ", "mem"):
        try:
            with open(f"/proc/{pid}/{name}", "rb") as file:
                if name == "environ":
                    file.read(1)
            result[f"{pid} {name}"] = "read"
        except PermissionError:
            result[f"{pid} {name}"] = "refused"
        except OSError as exc:
            result[f"{pid} {name}"] = f"error {exc.errno}"
print(json.dumps(result))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
def test_make_process_non_dumpable_clears_the_flag():
    code = (
        "from gym_sessions.non_dumpable import is_dumpable, make_process_non_dumpable\n"
        "print(is_dumpable(), make_process_non_dumpable(), is_dumpable())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split() == ["True", "True", "False"], result.stderr
    assert is_dumpable() is True  # the test process itself was left alone


def same_user_without_privileges() -> tuple[str, ...]:
    """A launcher running a command as this uid without any capability.

    Root's CAP_SYS_PTRACE overrides non-dumpability, so as root both the server
    and the reader run with every capability dropped: two processes of one uid,
    neither privileged, which is what non-dumpability is about.
    """
    if os.getuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux) to drop root's capabilities")
    return ("setpriv", "--bounding-set=-all", "--inh-caps=-all")


def read_as_same_user(launcher: tuple[str, ...], pids: list[int]) -> dict[str, str]:
    result = subprocess.run(
        [*launcher, sys.executable, "-c", READER, *map(str, pids)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(result.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux's")
@pytest.mark.parametrize("workers", [1, WORKERS])
def test_supervisor_and_workers_are_non_dumpable(servers, short_tmp, workers):
    launcher = same_user_without_privileges()

    # Control: the same reader reads a dumpable process of the same uid and privileges.
    control = subprocess.Popen([*launcher, sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)  # past its exec
        assert set(read_as_same_user(launcher, [control.pid]).values()) == {"read"}
    finally:
        control.kill()
        control.wait(10)

    # The secret comes from the environment: the supervisor blanks it in its
    # initial environment block (which forked workers share) as it reads it.
    server = start_server(
        COUNTER, workers=workers, tmpdir=os.path.join(short_tmp, "s"),
        secret=SECRET, launcher=launcher,
    )  # fmt: skip
    servers.append(server)
    if workers > 1:
        replacement = kill_one_worker_and_wait_for_its_replacement(server)
        assert replacement in worker_pids(server)
    holders = [server.process.pid, *sorted(worker_pids(server))]
    assert len(holders) == (1 if workers == 1 else 1 + workers)
    outcome = read_as_same_user(launcher, holders)
    assert outcome == {f"{pid} {name}": "refused" for pid in holders for name in ("environ", "mem")}
    # None of them shows the secret in its environment, nor inherited it.
    if os.getuid() == 0:
        for pid in holders:
            assert SECRET.encode() not in proc_file(pid, "environ")
        for pid in descendants(server.process.pid):
            assert SECRET.encode() not in proc_file(pid, "cmdline")
    assert server.health()["status"] == "ok"
