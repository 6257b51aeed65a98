"""Attacks on `envs.python_repl` from a session's own code, against real 4-worker servers.

Each attack runs in one session while an honest session (``x = 41``, then
``print(x + 1)``, verified against ``"42\\n"``) lives beside it and must still
score 1.0. The attacks that uid separation stops also run against
``--unsandboxed`` (as root, so with nothing in their way), where they must
succeed: that shows each test fails without the sandbox. The resource limits,
the private directory and the closed descriptors apply in both modes, so
those tests run sandboxed only (without this change the 2 GiB allocation
succeeds, nothing bounds the processes, there is no private directory and
the listening socket is inherited).

The sandbox needs root and util-linux's prlimit and setpriv; without them
these tests skip, naming what is missing (the in-process checks of the settings
run anyway), and on CI (``CI=true``, run as root) they fail instead.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import pwd
import shutil
import signal
import stat
import string
import tempfile
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from envs.python_repl import CHILD_MARKER, PythonReplServer
from envs.repl_sandbox import DEFAULT_UIDS, processes_of_uid
from gym_sessions.errors import StartupError
from gym_sessions.server.process import ServerProcess
from gym_sessions.settings import Settings
from tests.polling import eventually

from ..conftest import require_or_skip

# One xdist group: their servers share the host-wide uid range of the sandbox.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("repl_sandbox")]

ROOT = os.geteuid() == 0


@pytest.fixture
def sandbox_host() -> None:
    """Root and util-linux's prlimit and setpriv, as the sandbox needs; else skip (CI: fail)."""
    if not ROOT:
        reason = "the sandbox runs each session under a uid of its own, which needs root"
        if os.environ.get("CI"):
            pytest.fail(reason + " (CI runs as root)")
        pytest.skip(reason)
    for program in ("prlimit", "setpriv"):
        require_or_skip(program, "util-linux")


needs_root = pytest.mark.usefixtures("sandbox_host")
REPL = "envs.python_repl:PythonReplServer"
COOKIE = "gym_session"
SECRET = "repl-sandbox-test-secret-" + "z" * 20
WORKERS = 4
MODES = pytest.mark.parametrize("mode", ["sandboxed", "unsandboxed"])

# Served as tests.e2e.test_repl_sandbox:<name> (a configured instance is a valid target).
CAPPED_REPL = PythonReplServer(max_interpreters=8)
FEW_PROCESSES_REPL = PythonReplServer(processes=16)


# Client side ---------------------------------------------------------------------------


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request (requests land on any worker) and no cookie jar."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=60),
    ) as session:
        yield session


class Session:
    """One REPL session: its cookie, kept from its first reply."""

    def __init__(self, client: aiohttp.ClientSession, url: str) -> None:
        self.client = client
        self.url = url
        self.cookie: str | None = None

    async def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        headers = {"Cookie": f"{COOKIE}={self.cookie}"} if self.cookie else {}
        async with self.client.post(self.url + path, json=body, headers=headers) as reply:
            morsel = reply.cookies.get(COOKIE)
            if morsel is not None and morsel.value:
                self.cookie = morsel.value
            return reply.status, await reply.json()

    async def run(self, code: str, time_limit: float = 20) -> tuple[int, dict[str, Any]]:
        return await self.post("/run_code", {"code": code, "timeout": time_limit})

    async def value(self, code: str) -> Any:
        """The trailing expression's value (a Python literal) of ``code``, which must not fail."""
        status, data = await self.run(code)
        assert status == 200 and data["error"] is None, data
        return ast.literal_eval(data["value"])

    async def close(self) -> str:
        _, data = await self.post("/close_session", {})
        return data["outcome"]


class HonestSession(Session):
    """``x = 41`` now, ``print(x + 1)`` and a verify later: 1.0 if nothing disturbed it."""

    async def begin(self) -> HonestSession:
        status, data = await self.run("x = 41")
        assert status == 200 and data["error"] is None, data
        return self

    async def score(self) -> float:
        status, _ = await self.run("print(x + 1)")
        if status != 200:
            return 0.0
        _, verdict = await self.post("/verify", {"expected_stdout": "42\n"})
        return verdict["reward"]


async def honest_beside(client: aiohttp.ClientSession, url: str) -> HonestSession:
    return await HonestSession(client, url).begin()


# Processes -----------------------------------------------------------------------------


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rpartition(")")[2].split()[1])


def is_running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def live_processes_of(uid: int) -> list[int]:
    return [p.pid for p in processes_of_uid(uid) if not p.zombie]


def interpreters_by_worker(server: ServerProcess) -> dict[int, int]:
    """How many interpreters each worker runs (children whose command line has the marker)."""
    counts = dict.fromkeys(server.worker_pids(), 0)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                if CHILD_MARKER.encode() not in file.read().split(b"\0"):
                    continue
            parent = parent_of(int(entry))
        except OSError:
            continue
        if parent in counts and is_running(int(entry)):
            counts[parent] += 1
    return counts


def serve_mode(serve: Callable[..., ServerProcess], mode: str) -> ServerProcess:
    """A 4-worker REPL server signing with `SECRET`, sandboxed or not."""
    server_dir = tempfile.mkdtemp(prefix="gs-secret-")  # root's, mode 0700
    secret_file = os.path.join(server_dir, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as file:
        file.write(SECRET + "\n")
    extra = ("--unsandboxed",) if mode == "unsandboxed" else ()
    try:
        return serve(REPL, "--secret-file", secret_file, *extra, workers=WORKERS)
    finally:
        shutil.rmtree(server_dir)  # read once, at the start


def kill_leftovers(pids: list[int]) -> None:
    """SIGKILL processes an unsandboxed attack left behind (the sandbox would have)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# Attack code (runs in the attacker's session; $names are filled in by `attack_code`) ----


def attack_code(template: str, **values: object) -> str:
    """``template`` with each ``$name`` replaced by the literal of ``values[name]``."""
    literals = {name: repr(value) for name, value in values.items()}
    return string.Template(template).substitute(literals)


PARENT_OF = """
def parent_of(pid):
    with open(f"/proc/{pid}/stat") as file:
        return int(file.read().rpartition(")")[2].split()[1])
"""

READ_SERVER = (
    PARENT_OF
    + """
import os
# Sent reversed: the request carrying this code must not put the needles in the worker.
NEEDLES = {"secret": $secret[::-1], "cookie": $cookie[::-1]}
CHUNK = 8 << 20
def children_of(parent):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if parent_of(int(entry)) == parent:
                    found.append(int(entry))
            except OSError:
                pass
    return found
def read_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            file.read()
        return "read"
    except OSError as exc:
        return type(exc).__name__
def regions(pid):
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            special = len(fields) > 5 and fields[5].startswith("[v")
            if "r" in fields[1] and not special and end - start <= 1 << 28:
                yield start, end
def search_memory(pid):
    found = set()
    try:
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for start, end in regions(pid):
                tail = b""
                for offset in range(start, end, CHUNK):
                    try:
                        mem.seek(offset)
                        data = tail + mem.read(min(CHUNK, end - offset))
                    except OSError:
                        break
                    found.update(name for name, needle in NEEDLES.items() if needle in data)
                    tail = data[-64:]
    except OSError as exc:
        return type(exc).__name__
    return sorted(found)
worker = os.getppid()
supervisor = parent_of(worker)
workers = children_of(supervisor)
found_in_workers = set()
worker_memory = None
for pid in workers:
    result = search_memory(pid)
    if isinstance(result, str):
        worker_memory = result
        break
    found_in_workers.update(result)
{
    "worker environ": read_environ(worker),
    "supervisor environ": read_environ(supervisor),
    "worker memory": worker_memory or sorted(found_in_workers),
    "supervisor memory": search_memory(supervisor),
}
"""
)

VICTIM_MARKER = """
import ctypes, os
marker = bytearray(b"victim-marker-0123456789")
(os.getpid(), ctypes.addressof((ctypes.c_char * len(marker)).from_buffer(marker)))
"""

WRITE_OTHER_MEMORY = """
try:
    with open("/proc/$pid/mem", "r+b", buffering=0) as mem:
        mem.seek($address)
        seen = mem.read(24)
        mem.seek($address)
        mem.write(b"OVERWRITTEN-BY-ATTACKER!")
    result = seen
except OSError as exc:
    result = type(exc).__name__
result
"""

FORGE_REPLY = """
import ctypes, os, stat
libc = ctypes.CDLL(None, use_errno=True)
SYS_pidfd_getfd = 438
forged = b'{"stdout": "forged\\\\n", "stderr": "", "value": null, "error": null}\\n'
pidfd = os.pidfd_open($pid)
channels, refusals = {}, set()
for target in range(3, 32):
    fd = libc.syscall(SYS_pidfd_getfd, pidfd, target, 0)
    if fd < 0:
        refusals.add(os.strerror(ctypes.get_errno()))
    elif stat.S_ISSOCK(os.fstat(fd).st_mode) or stat.S_ISFIFO(os.fstat(fd).st_mode):
        channels[target] = fd
    else:
        os.close(fd)
if channels:  # the child dups its request channel first, its reply channel second
    os.write(channels[max(channels)], forged)
(len(channels), sorted(refusals))
"""

KILL = (
    PARENT_OF
    + """
import os, signal
def kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
        return "killed"
    except OSError as exc:
        return type(exc).__name__
worker = os.getppid()
supervisor = parent_of(worker)
$targets
"""
)

ESCAPES = """
import os, subprocess, time
sleeper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
read_end, write_end = os.pipe()
if os.fork() == 0:  # a double fork: the grandchild's parent exits at once
    os.setsid()
    if os.fork() == 0:
        os.write(write_end, str(os.getpid()).encode())
        time.sleep(1000)
    os._exit(0)
os.close(write_end)
grandchild = int(os.read(read_end, 32))
os.wait()
(os.getuid(), sleeper.pid, grandchild)
"""

FORK_BOMB = """
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.05)
"""


# uid separation: each attack blocked sandboxed, successful unsandboxed ----------------


@needs_root
@MODES
async def test_worker_and_supervisor_environ_and_memory_are_closed(serve, client, mode):
    server = serve_mode(serve, mode)
    honest = await honest_beside(client, server.url)
    attack = attack_code(
        READ_SERVER, secret=SECRET.encode()[::-1], cookie=honest.cookie.encode()[::-1]
    )
    stolen = await Session(client, server.url).value(attack)
    if mode == "unsandboxed":
        print(f"\nunsandboxed, as root, the attacker read {stolen}")
        assert stolen["worker environ"] == stolen["supervisor environ"] == "read"
        assert "secret" in stolen["worker memory"]  # and often the honest session's cookie
        assert "secret" in stolen["supervisor memory"]
        return
    assert stolen == {
        "worker environ": "PermissionError",
        "supervisor environ": "PermissionError",
        "worker memory": "PermissionError",
        "supervisor memory": "PermissionError",
    }
    assert await honest.score() == 1.0


@needs_root
@MODES
async def test_another_sessions_memory_cannot_be_read_or_written(serve, client, mode):
    server = serve_mode(serve, mode)
    honest = await honest_beside(client, server.url)
    victim = Session(client, server.url)
    pid, address = await victim.value(VICTIM_MARKER)
    attacker = Session(client, server.url)
    seen = await attacker.value(attack_code(WRITE_OTHER_MEMORY, pid=pid, address=address))
    after = await victim.value("bytes(marker)")
    if mode == "unsandboxed":
        assert seen == b"victim-marker-0123456789"
        assert after == b"OVERWRITTEN-BY-ATTACKER!"
        return
    assert seen == "PermissionError"
    assert after == b"victim-marker-0123456789"
    assert await honest.score() == 1.0


@needs_root
@MODES
async def test_pidfd_getfd_cannot_forge_another_sessions_reply(serve, client, mode):
    server = serve_mode(serve, mode)
    victim = await honest_beside(client, server.url)  # its next reply is the target
    pid = await victim.value("import os\nos.getpid()")
    taken, refusals = await Session(client, server.url).value(attack_code(FORGE_REPLY, pid=pid))
    status, data = await victim.run("print(x + 1)")
    if mode == "unsandboxed":
        assert taken > 0, refusals
        assert data.get("stdout") == "forged\n", data
        return
    assert (taken, refusals) == (0, ["Operation not permitted"])
    assert status == 200 and data["stdout"] == "42\n"
    _, verdict = await victim.post("/verify", {"expected_stdout": "42\n"})
    assert verdict["reward"] == 1.0


@needs_root
@MODES
async def test_interpreters_worker_and_supervisor_cannot_be_killed(serve, client, mode):
    server = serve_mode(serve, mode)
    workers = server.worker_pids()
    honest = await honest_beside(client, server.url)
    victim_pid = await honest.value("import os\nos.getpid()")
    attacker = Session(client, server.url)
    await attacker.value("0")  # the attacker's interpreter exists before it strikes
    # Its own worker last: the attacker dies with it.
    targets = f"(kill({victim_pid}), kill(supervisor), kill(worker))"
    attack = string.Template(KILL).substitute(targets=targets)
    if mode == "unsandboxed":
        try:
            with contextlib.suppress(aiohttp.ClientError):
                await attacker.run(attack)
            assert await eventually(lambda: not is_running(victim_pid))
            assert await eventually(lambda: server.process.poll() is not None)
        finally:
            kill_leftovers(workers)  # orphaned by the supervisor's death
        return
    status, data = await attacker.run(attack)
    assert status == 200 and ast.literal_eval(data["value"]) == ("PermissionError",) * 3, data
    assert server.process.poll() is None
    assert server.worker_pids() == workers
    assert await honest.score() == 1.0


# Limits, leftovers and the private directory (sandboxed) -------------------------------


@needs_root
async def test_a_2_gib_allocation_fails_and_the_worker_survives(serve, client):
    server = serve_mode(serve, "sandboxed")
    workers = server.worker_pids()
    honest = await honest_beside(client, server.url)
    attacker = Session(client, server.url)
    status, data = await attacker.run("big = bytearray(2 * 1024**3)")
    assert status == 200 and data["error"].endswith("MemoryError\n"), data
    assert await attacker.value("small = bytearray(100 * 1024**2)\nlen(small)") == 100 * 1024**2
    assert server.worker_pids() == workers
    assert await honest.score() == 1.0


@needs_root
@MODES
async def test_setsid_and_double_fork_escapes_die_with_the_session(serve, client, mode):
    server = serve_mode(serve, mode)
    honest = await honest_beside(client, server.url)
    attacker = Session(client, server.url)
    uid, sleeper, grandchild = await attacker.value(ESCAPES)
    assert is_running(sleeper) and is_running(grandchild)
    assert await attacker.close() == "closed"

    def escapes_gone() -> bool:
        return not is_running(sleeper) and not is_running(grandchild)

    if mode == "unsandboxed":
        try:
            await asyncio.sleep(1.0)
            assert not escapes_gone()  # the process group was killed; these left it
        finally:
            kill_leftovers([sleeper, grandchild])
        return
    assert uid in DEFAULT_UIDS
    assert await eventually(escapes_gone)
    assert await eventually(lambda: not processes_of_uid(uid))  # zombies reaped too
    assert await honest.score() == 1.0


@needs_root
async def test_stopping_the_server_kills_every_session_and_removes_its_files(serve, client):
    server = serve_mode(serve, "sandboxed")
    sessions = [Session(client, server.url) for _ in range(4)]
    escapes = await asyncio.gather(*[session.value(ESCAPES) for session in sessions])
    homes = await asyncio.gather(*[session.value("import os\nos.getcwd()") for session in sessions])
    assert all(os.path.isdir(home) for home in homes)
    server.stop()  # SIGTERM: each worker releases its sessions before it exits
    for uid, sleeper, grandchild in escapes:
        assert not is_running(sleeper) and not is_running(grandchild)
        assert not live_processes_of(uid)
    assert not any(os.path.exists(home) for home in homes)


@needs_root
async def test_escapes_of_a_killed_worker_die_when_its_replacement_starts(serve, client):
    server = serve_mode(serve, "sandboxed")
    attacker = Session(client, server.url)
    uid, sleeper, grandchild = await attacker.value(ESCAPES)
    worker = await attacker.value("import os\nos.getppid()")
    honest = await honest_beside(client, server.url)
    for _ in range(40):  # an honest session on another worker, which must not notice
        if await honest.value("import os\nos.getppid()") != worker:
            break
        honest = await honest_beside(client, server.url)
    os.kill(worker, signal.SIGKILL)  # no release: its interpreters die, the escapes do not
    # Dead and replaced (right after the kill the worker may still be listed).
    assert await eventually(
        lambda: worker not in server.worker_pids() and len(server.worker_pids()) == WORKERS,
        within=30,
    )
    assert await eventually(lambda: not is_running(sleeper) and not is_running(grandchild))
    assert not live_processes_of(uid)
    assert await honest.score() == 1.0


@needs_root
async def test_each_session_gets_a_uid_and_a_private_directory_removed_at_close(serve, client):
    server = serve_mode(serve, "sandboxed")
    honest = await honest_beside(client, server.url)
    where = (
        "import os, tempfile\n"
        "open('notes.txt', 'w').write('mine')\n"
        "open(f'/tmp/gym-repl-test-{os.getuid()}', 'w').write('left in /tmp')\n"
        "(os.getuid(), os.getgid(), os.getgroups(), os.getcwd(), tempfile.gettempdir(), "
        "os.environ['HOME'], sorted(os.environ))"
    )
    sessions = [Session(client, server.url) for _ in range(8)]
    seen = await asyncio.gather(*[session.value(where) for session in sessions])
    uids = [uid for uid, *_ in seen]
    assert len(set(uids)) == len(sessions), "uids are unique across the workers"
    for uid, gid, groups, cwd, tmp, home, names in seen:
        assert uid in DEFAULT_UIDS and gid == uid and groups == []
        assert cwd == tmp == home
        assert names == ["HOME", "LANG", "PATH", "TMPDIR"]  # nothing of the worker's
        info = os.stat(cwd)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (uid, 0o700)
    other_home = seen[1][3]
    _, data = await sessions[0].run(f"import os\nos.listdir({other_home!r})")
    assert "PermissionError" in data["error"]
    homes = [cwd for _, _, _, cwd, *_ in seen]
    outcomes = await asyncio.gather(*[session.close() for session in sessions])
    assert outcomes == ["closed"] * len(sessions)
    assert await eventually(lambda: not any(os.path.exists(home) for home in homes))
    assert not any(os.path.exists(f"/tmp/gym-repl-test-{uid}") for uid in uids)
    assert await honest.score() == 1.0


@needs_root
async def test_the_interpreter_inherits_no_descriptor_of_its_worker(serve, client):
    server = serve(REPL)  # one worker: its listening socket used to be inherited
    honest = await honest_beside(client, server.url)
    descriptors = await Session(client, server.url).value(
        "import os\n"
        "listed = sorted(int(fd) for fd in os.listdir('/proc/self/fd'))\n"
        "# The listing's own descriptor is closed by now.\n"
        "[(fd, os.readlink(f'/proc/self/fd/{fd}')) for fd in listed\n"
        " if fd > 2 and os.path.exists(f'/proc/self/fd/{fd}')]"
    )
    assert len(descriptors) == 2, f"the two protocol channels only, not {descriptors}"
    assert await honest.score() == 1.0


# Capacity and the process limit --------------------------------------------------------


@needs_root
async def test_cookieless_calls_stop_at_the_cap_with_503(serve, client):
    server = serve("tests.e2e.test_repl_sandbox:CAPPED_REPL", workers=WORKERS)
    honest = await honest_beside(client, server.url)
    replies = await asyncio.gather(*[Session(client, server.url).run("y = 1") for _ in range(40)])
    served = [data for status, data in replies if status == 200]
    refused = [data for status, data in replies if status != 200]
    assert {status for status, _ in replies} <= {200, 503}
    assert len(served) <= WORKERS * 8 - 1  # the honest session holds one place
    assert len(refused) >= 40 - (WORKERS * 8 - 1)
    assert all(data["error"]["code"] == "capacity_reached" for data in refused)
    counts = interpreters_by_worker(server)
    assert max(counts.values()) <= 8, counts
    assert sum(counts.values()) == len(served) + 1, counts  # a refused call started nothing
    for _ in range(8):
        async with client.get(server.url + "/health") as reply:
            assert (await reply.json())["sessions"] <= 8
    assert await honest.score() == 1.0


@needs_root
async def test_a_fork_bomb_is_bounded_by_the_process_limit(serve, client):
    server = serve("tests.e2e.test_repl_sandbox:FEW_PROCESSES_REPL", workers=WORKERS)
    workers = server.worker_pids()
    honest = await honest_beside(client, server.url)
    bomber = Session(client, server.url)
    uid = await bomber.value("import os\nos.getuid()")
    bomb = asyncio.create_task(bomber.run(FORK_BOMB, time_limit=4))
    peak = 0
    while not bomb.done():
        peak = max(peak, len(processes_of_uid(uid)))
        await asyncio.sleep(0.02)
    status, data = bomb.result()
    assert status == 500 and "timed out" in data["error"]["message"]
    assert 8 < peak <= 16, f"at most 16 processes of the session's uid, saw {peak}"
    assert await eventually(lambda: not live_processes_of(uid))
    assert server.worker_pids() == workers
    assert await bomber.value("1 + 1") == 2  # a fresh interpreter
    assert await honest.score() == 1.0


# Settings (in-process) -----------------------------------------------------------------


def test_a_server_that_is_not_root_needs_unsandboxed(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(StartupError, match="--unsandboxed"):
        PythonReplServer().check_settings(Settings())
    server = PythonReplServer()
    server.check_settings(Settings(unsandboxed=True))
    assert server.sandbox.mode == "unsandboxed"


@pytest.mark.parametrize(
    "settings",
    [
        {"max_interpreters": 0},
        {"max_interpreters": True},
        {"address_space_bytes": 1024},
        {"cpu_seconds": 0},
        {"processes": -1},
        {"open_files": 3},
        {"file_size_bytes": 1.5},
        {"uids": range(0, 100)},
        {"uids": range(2_000_000_000, 2_000_000_000)},
        {"uids": range(60_000, 70_000)},
        {"uids": range(2**32 - 10, 2**32)},
        {"uids": range(2_000_000_000, 2_000_000_100, 2)},
        {"sandbox_dir": "relative/dir"},
    ],
    ids=lambda settings: json.dumps(settings, default=repr),
)
def test_nonsense_settings_are_refused(settings):
    with pytest.raises(ValueError):
        PythonReplServer(**settings)


@needs_root
def test_a_uid_range_holding_a_real_user_is_refused(monkeypatch):
    alice = pwd.struct_passwd(("alice", "x", DEFAULT_UIDS[5], 100, "", "/", "/bin/sh"))
    users = pwd.getpwall()
    monkeypatch.setattr(pwd, "getpwall", lambda: [*users, alice])
    with pytest.raises(StartupError, match="include existing user alice"):
        PythonReplServer().check_settings(Settings())
    monkeypatch.undo()
    with pytest.raises(StartupError, match="fewer than workers"):
        PythonReplServer(uids=DEFAULT_UIDS[:10]).check_settings(Settings(workers=4))
