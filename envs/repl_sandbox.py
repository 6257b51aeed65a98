"""Where the interpreters of `envs.python_repl` run: one unprivileged uid per session, or not.

A `ReplSandbox` belongs to one worker process. For every interpreter it opens
a `SessionBox`: the private directory the interpreter runs in (its cwd, HOME
and TMPDIR) and the command that starts it. The box is closed when the
interpreter ends, which kills every process the session started and removes
the directory.

Sandboxed (the server runs as root and ``--unsandboxed`` is not given):

- Each box leases a uid (used as the gid too) from a range reserved for the
  sandbox. A lease is an ``fcntl.flock`` on ``<state_dir>/locks/<uid>``, so a
  uid is held by one box of one worker on the whole host, and the kernel drops
  the lock of a worker that dies. Taking a uid first kills whatever still runs
  under it and wipes its directory (a dead worker's leftovers), and every
  worker, when it starts, does that for each uid whose directory outlived its
  lock (so the replacement of a killed worker ends its sessions' escapes).
- The interpreter starts as ``prlimit <limits> -- setpriv --reuid=UID
  --regid=UID --clear-groups --no-new-privs --inh-caps=-all
  --bounding-set=-all --pdeathsig=KILL -- PYTHON ...``: util-linux tools set
  the resource limits and drop every privilege before the interpreter runs.
  Another uid cannot signal, ptrace, ``pidfd_getfd`` or read ``/proc/<pid>/
  {environ,mem,maps,fd}`` of the worker (root), the supervisor or another
  session: the kernel's own permission checks do the work.
- Closing the box SIGKILLs every process whose real, effective or saved uid is
  the lease's, until none is alive (``setsid`` and double-fork escapes
  included: they keep the uid), reaps the ones the worker adopted (it is a
  child subreaper, so orphans of the session come to it rather than to an
  init that may not reap), removes the session's files from its directory and
  from ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and only then releases the uid.
- ``RLIMIT_NPROC`` counts the processes of a uid, so the process limit is a
  per-session limit here.

Unsandboxed (``--unsandboxed``, or a server that is not root and says so): the
interpreter runs as the worker's own user, with the same limits except the
process limit (``RLIMIT_NPROC`` would count every process of that user) and
clamped to the worker's own hard limits; its directory is a fresh
``mkdtemp``; closing kills its process group only.

``<state_dir>`` (default ``/run/gym-sessions-repl``, root-owned, mode 0711)
holds ``locks/`` (0700) and ``homes/`` (0711) with one ``<uid>`` directory
(0700, owned by the uid) per live interpreter. Servers that share a uid range
on one host must share the state directory (the default does).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import grp
import logging
import os
import pwd
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from gym_sessions.errors import CapacityReachedError, EnvError, StartupError, exception_text

__all__ = [
    "DEFAULT_STATE_DIR",
    "DEFAULT_UIDS",
    "ReplSandbox",
    "ResourceLimits",
    "SessionBox",
    "check_uid_range",
    "processes_of_uid",
]

logger = logging.getLogger("gym_sessions.python_repl")

MIB = 1024 * 1024
GIB = 1024 * MIB
# Far above login users (1000-59999), systemd's dynamic users (61184-65519) and
# the usual /etc/subuid ranges of rootless containers (100000 + 65536 n), below
# 2**31 (some tools still treat uids as signed 32-bit numbers).
DEFAULT_UIDS = range(2_000_000_000, 2_000_004_096)
DEFAULT_STATE_DIR = "/run/gym-sessions-repl"
SHARED_TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# A fixed PATH: the worker's may name directories the sandbox user cannot enter.
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
PROBE_UID = 65534  # nobody: "can another user run this Python?" (only asked, never leased)
# What the child needs, and which build runs (see `ReplSandbox._probe`).
PROBE_SOURCE = (
    "import ast, ctypes, json, sys; print(sys.version); sys.exit(sys.version_info < (3, 8))"
)
KILL_WITHIN = 5.0  # seconds to get every process of a uid killed before giving up
_PR_SET_CHILD_SUBREAPER = 36


# Resource limits -----------------------------------------------------------------------


@dataclass(frozen=True)
class ResourceLimits:
    """Limits of each interpreter process (and of each process it starts).

    ``None`` means unlimited. Each is applied with util-linux ``prlimit``, as
    the soft and the hard limit, so the session cannot raise it again.

    Attributes:
        address_space_bytes: ``RLIMIT_AS``: virtual memory per process; a larger
            allocation raises ``MemoryError`` in the session's code.
        cpu_seconds: ``RLIMIT_CPU``: CPU time per process over its whole life
            (all calls of a session's interpreter add up); past it the process
            is killed and the session's next call starts a fresh interpreter.
        processes: ``RLIMIT_NPROC``: processes and threads of the session's uid
            (sandboxed only: unsandboxed it would count all of the server
            user's processes, so it is not applied there).
        open_files: ``RLIMIT_NOFILE``: open file descriptors per process.
        file_size_bytes: ``RLIMIT_FSIZE``: the largest file a process may write.
    """

    address_space_bytes: int | None = 1 * GIB
    cpu_seconds: int | None = 300
    processes: int | None = 64
    open_files: int | None = 256
    file_size_bytes: int | None = 128 * MIB

    def __post_init__(self) -> None:
        # Below these the interpreter itself cannot start, so the limit is a mistake.
        minimums = {
            "address_space_bytes": 64 * MIB,
            "cpu_seconds": 1,
            "processes": 1,
            "open_files": 16,
            "file_size_bytes": 1,
        }
        for name, minimum in minimums.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer or None, not {value!r}")
            if value < minimum:
                raise ValueError(f"{name} must be at least {minimum} (or None), not {value}")

    def prlimit_options(self, *, per_uid_processes: bool) -> list[str]:
        """``prlimit`` options setting these limits (soft = hard); core dumps always off.

        Args:
            per_uid_processes: Whether to apply the process limit (only when
                the interpreter has a uid of its own).
        """
        values = {
            "as": self.address_space_bytes,
            "cpu": self.cpu_seconds,
            "nofile": self.open_files,
            "fsize": self.file_size_bytes,
            "core": 0,
        }
        if per_uid_processes:
            values["nproc"] = self.processes
        if os.geteuid() != 0:
            values = {name: _within_hard_limit(name, value) for name, value in values.items()}
        return [f"--{name}={_limit_text(value)}" for name, value in values.items()]

    def as_dict(self) -> dict[str, int | None]:
        """The limits by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_RLIMITS = {
    "as": "RLIMIT_AS",
    "cpu": "RLIMIT_CPU",
    "nofile": "RLIMIT_NOFILE",
    "fsize": "RLIMIT_FSIZE",
    "core": "RLIMIT_CORE",
    "nproc": "RLIMIT_NPROC",
}


def _within_hard_limit(name: str, value: int | None) -> int | None:
    """``value`` lowered to the worker's hard limit: an unprivileged user cannot raise it."""
    import resource

    hard = resource.getrlimit(getattr(resource, _RLIMITS[name]))[1]
    if hard == resource.RLIM_INFINITY:
        return value
    return hard if value is None else min(value, hard)


def _limit_text(value: int | None) -> str:
    text = "unlimited" if value is None else str(value)
    return f"{text}:{text}"


# uid ranges ----------------------------------------------------------------------------


def check_uid_range(uids: range) -> range:
    """``uids`` if it is a usable sandbox range, else `ValueError`.

    A usable range is a non-empty ``range`` with step 1 of uids from 1000 up,
    below ``2**32 - 1`` (``(uid_t) -1`` means "unchanged" to the kernel) and
    without 65534 (nobody) or 65535 (``(uint16_t) -1``).
    """
    if not isinstance(uids, range) or uids.step != 1 or len(uids) == 0:
        raise ValueError(f"uids must be a non-empty range with step 1, not {uids!r}")
    if uids.start < 1000:
        raise ValueError(f"uids must start at 1000 or above (system users), not {uids.start}")
    if uids.stop - 1 > 2**32 - 2:
        raise ValueError(f"uids must stay below 2**32 - 1, not end at {uids.stop - 1}")
    if 65534 in uids or 65535 in uids:
        raise ValueError("uids must not include 65534 (nobody) or 65535")
    return uids


def _named_ids_in(uids: range) -> list[str]:
    """Users and groups of the system databases whose ids fall in ``uids``."""
    taken = [f"user {u.pw_name} ({u.pw_uid})" for u in pwd.getpwall() if u.pw_uid in uids]
    taken += [f"group {g.gr_name} ({g.gr_gid})" for g in grp.getgrall() if g.gr_gid in uids]
    return taken


# Processes of a uid (Linux /proc) -----------------------------------------------------


class ProcessInfo(NamedTuple):
    """What ``/proc/<pid>/status`` says about one process."""

    pid: int
    ppid: int
    zombie: bool


def _status_fields(pid: str) -> dict[str, str] | None:
    try:
        with open(f"/proc/{pid}/status", "rb") as file:
            text = file.read().decode("utf-8", "replace")
    except OSError:  # gone meanwhile
        return None
    wanted = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("State", "PPid", "Uid"):
            wanted[key] = value.strip()
    return wanted if len(wanted) == 3 else None


def processes_of_uid(uid: int) -> list[ProcessInfo]:
    """Every process whose real, effective or saved uid is ``uid``, zombies included.

    Reads ``/proc/<pid>/status``, which any user may read for any process, so
    a process that made itself non-dumpable (``/proc/<pid>`` then belongs to
    root) is still found.
    """
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        status = _status_fields(entry)
        if status is None:
            continue
        real, effective, saved = (int(x) for x in status["Uid"].split()[:3])
        if uid in (real, effective, saved):
            found.append(ProcessInfo(int(entry), int(status["PPid"]), status["State"][:1] == "Z"))
    return found


def kill_processes_of_uid(uid: int, spare: frozenset[int], within: float = KILL_WITHIN) -> bool:
    """SIGKILL every process of ``uid`` until none is alive; True if none is within ``within`` s.

    A killed process cannot fork any more, so each round can only find
    processes born during the one before: rounds repeat until a scan finds
    only zombies. Zombies this process adopted are reaped, except ``spare``:
    the interpreters the event loop reaps itself (reaping one of those would
    steal its exit status).
    """
    deadline = time.monotonic() + within
    me = os.getpid()
    while True:
        alive = False
        for process in processes_of_uid(uid):
            if process.zombie:
                if process.ppid == me and process.pid not in spare:
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(process.pid, os.WNOHANG)
                continue
            alive = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
        if not alive:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def become_child_subreaper() -> None:
    """Make this process adopt its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``).

    A session's ``setsid`` or double-forked processes then stay children of
    the worker, which reaps them when it closes the session, instead of going
    to PID 1 (which, in a container, may never reap them: their zombies would
    count against the uid's process limit for every later session).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _remove_path(path: str) -> None:
    """Remove a file, link or directory tree without following symbolic links."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links out of the tree
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _remove_files_of_uid(uid: int, directories: tuple[str, ...] = SHARED_TEMP_DIRS) -> None:
    """Remove the entries ``uid`` owns at the top of the shared temporary directories."""
    for directory in directories:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid == uid:
                    _remove_path(entry.path)


# Children the event loop reaps ---------------------------------------------------------


class LoopChildren:
    """Pids of interpreters whose exit status the event loop still has to collect.

    Teardown (in a thread) reaps the zombies of a session's other processes but
    must leave these alone: a stolen exit status leaves ``Process.wait()``
    waiting forever.
    """

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self._lock = threading.Lock()

    def add(self, pid: int) -> None:
        with self._lock:
            self._pids.add(pid)

    def discard(self, pid: int) -> None:
        with self._lock:
            self._pids.discard(pid)

    def snapshot(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._pids)


# Boxes ---------------------------------------------------------------------------------


class SessionBox:
    """One interpreter's private directory and how to start and end what runs in it."""

    uid: int | None = None

    def __init__(self, home: str) -> None:
        self.home = home
        self._closed = False
        self._closing = threading.Lock()

    def command(self, program: list[str]) -> list[str]:
        """The argv that runs ``program`` inside the box."""
        return program

    def environment(self) -> dict[str, str]:
        """The whole environment of the interpreter: nothing of the worker's."""
        return {
            "PATH": SANDBOX_PATH,
            "HOME": self.home,
            "TMPDIR": self.home,
            "LANG": "C.UTF-8",
        }

    def close(self) -> None:
        """Kill what still runs in the box and remove its files (once; thread-safe)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            self._teardown()

    def _teardown(self) -> None:
        shutil.rmtree(self.home, ignore_errors=True)


class UnsandboxedBox(SessionBox):
    """A box that runs as the worker's user: limits and a private directory, nothing more."""

    def __init__(self, home: str, limits: list[str], prlimit: str | None) -> None:
        super().__init__(home)
        self._limits = limits
        self._prlimit = prlimit

    def command(self, program: list[str]) -> list[str]:
        if self._prlimit is None:  # no util-linux (macOS, say): no limits
            return program
        return [self._prlimit, *self._limits, "--", *program]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), "PATH": os.environ.get("PATH", SANDBOX_PATH)}


class LeasedUidBox(SessionBox):
    """A box with a uid of its own, held by an ``flock`` until the box is closed."""

    def __init__(self, uid: int, home: str, lock_fd: int, sandbox: ReplSandbox) -> None:
        super().__init__(home)
        self.uid = uid
        self._lock_fd = lock_fd
        self._sandbox = sandbox

    def command(self, program: list[str]) -> list[str]:
        sandbox = self._sandbox
        assert self.uid is not None  # a leased box always has its uid
        return [
            sandbox.prlimit,
            *sandbox.limits.prlimit_options(per_uid_processes=True),
            "--",
            *_setpriv_command(sandbox.setpriv, self.uid),
            *program,
        ]

    def _teardown(self) -> None:
        assert self.uid is not None
        try:
            if not kill_processes_of_uid(self.uid, self._sandbox.loop_children.snapshot()):
                # Released anyway: whoever takes the uid next kills again first.
                logger.warning("sandbox uid %d: processes still alive after SIGKILL", self.uid)
            _remove_files_of_uid(self.uid)
            shutil.rmtree(self.home, ignore_errors=True)
        finally:
            os.close(self._lock_fd)  # releases the uid


def _setpriv_command(setpriv: str, uid: int) -> list[str]:
    return [
        setpriv,
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--no-new-privs",  # setuid binaries cannot give the uid back any privilege
        "--inh-caps=-all",
        "--bounding-set=-all",
        "--pdeathsig=KILL",  # set after the uid change, which would clear it
        "--",
    ]


# The sandbox of one worker ------------------------------------------------------------


class ReplSandbox:
    """How one worker starts its interpreters: each under a leased uid, or as itself.

    Args:
        limits: Resource limits of every interpreter process.
        uids: The uids (and gids) the sandbox leases; see `check_uid_range`.
        state_dir: Root-owned directory of the uid locks and the sessions' homes.
        python: The interpreter to run; ``None`` picks one (see `choose_python`).
    """

    def __init__(
        self,
        limits: ResourceLimits,
        uids: range = DEFAULT_UIDS,
        state_dir: str = DEFAULT_STATE_DIR,
        python: str | None = None,
    ) -> None:
        self.limits = limits
        self.uids = check_uid_range(uids)
        if not os.path.isabs(state_dir):
            raise ValueError(f"sandbox_dir must be an absolute path, not {state_dir!r}")
        self.state_dir = state_dir
        self.configured_python = python
        self.sandboxed = False
        self.python = python or sys.executable
        self.prlimit: str = ""
        self.setpriv: str = ""
        self.loop_children = LoopChildren()

    @property
    def mode(self) -> str:
        """``sandboxed`` or ``unsandboxed``."""
        return "sandboxed" if self.sandboxed else "unsandboxed"

    @property
    def locks_dir(self) -> str:
        return os.path.join(self.state_dir, "locks")

    @property
    def homes_dir(self) -> str:
        return os.path.join(self.state_dir, "homes")

    def configure(self, unsandboxed: bool) -> None:
        """Pick the mode: sandboxed when root unless ``unsandboxed``; prepare it.

        Raises:
            StartupError: not root and not ``unsandboxed``, or the sandbox
                cannot work here (tools, directories, uids, no usable Python).
        """
        root = os.geteuid() == 0
        if not root and not unsandboxed:
            raise StartupError(
                "the Python REPL sandbox runs each session under its own uid, which needs "
                f"root, and this server runs as uid {os.geteuid()}: run it as root, or pass "
                "--unsandboxed to run session code as this user, unprotected (see "
                "docs/operating/repl-sandbox.md)"
            )
        self.sandboxed = root and not unsandboxed
        prlimit = shutil.which("prlimit", path=f"{os.environ.get('PATH', '')}:/usr/bin:/bin")
        if not self.sandboxed:
            self.prlimit = prlimit or ""
            self.python = self.configured_python or sys.executable
            return
        setpriv = shutil.which("setpriv", path=f"{os.environ.get('PATH', '')}:/usr/bin:/bin")
        if prlimit is None or setpriv is None:
            raise StartupError(
                "the Python REPL sandbox needs util-linux's prlimit and setpriv "
                "(apt-get install util-linux)"
            )
        self.prlimit, self.setpriv = prlimit, setpriv
        taken = _named_ids_in(self.uids)
        if taken:
            raise StartupError(
                f"the sandbox uids {self.uids.start}-{self.uids.stop - 1} include existing "
                f"{', '.join(taken[:3])}: choose another uids range"
            )
        self._make_state_dirs()
        self.python = self.choose_python()

    def _make_state_dirs(self) -> None:
        try:
            for path, mode in (
                (self.state_dir, 0o711),
                (self.locks_dir, 0o700),
                (self.homes_dir, 0o711),
            ):
                with contextlib.suppress(FileExistsError):
                    os.mkdir(path, mode)
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0:
                    raise StartupError(
                        f"sandbox directory {path} is not a directory owned by root; "
                        "remove it or choose another sandbox_dir"
                    )
                os.chmod(path, mode)
        except OSError as exc:
            raise StartupError(
                f"cannot create the sandbox directory {self.state_dir}: {exc} "
                "(choose another sandbox_dir)"
            ) from exc

    def choose_python(self) -> str:
        """The first Python that an unprivileged user can run (Python >= 3.8).

        The configured one if any, else this worker's own interpreter (with its
        packages), else ``/usr/local/bin/python3`` or ``/usr/bin/python3``. A
        venv's Python can be a link into a directory closed to other users
        (``/root``), so each is tried for real, as uid 65534 under the same
        ``prlimit`` and ``setpriv`` as a session, and the worker's own must
        report the worker's own version.

        Raises:
            StartupError: none of them runs.
        """
        candidates = (
            [self.configured_python]
            if self.configured_python
            else [sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"]
        )
        failures = []
        for candidate in dict.fromkeys(candidates):
            failure = self._probe(candidate)
            if failure is None:
                return candidate
            failures.append(f"{candidate}: {failure}")
        raise StartupError(
            "no Python the sandbox user can run (pass python= to PythonReplServer): "
            + "; ".join(failures)
        )

    def _probe(self, python: str) -> str | None:
        """Why ``python`` cannot serve as the sandbox's interpreter, or ``None`` if it can."""
        if not os.path.exists(python):
            return "not found"
        command = [
            self.prlimit,
            *self.limits.prlimit_options(per_uid_processes=False),
            "--",
            *_setpriv_command(self.setpriv, PROBE_UID),
            python,
            "-I",
            "-c",
            PROBE_SOURCE,
        ]
        try:
            result = subprocess.run(
                command,
                env={"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"},
                cwd="/",
                capture_output=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return str(exc)
        if result.returncode != 0:
            said = result.stderr.decode(errors="replace").strip().splitlines()
            return said[-1] if said else f"exit status {result.returncode}"
        version = result.stdout.decode(errors="replace").strip()
        if python == sys.executable and version != sys.version:
            # setpriv execs with root's capabilities still in effect, so a binary in a
            # directory closed to the uid starts, then loads another build's library
            # or standard library (a pyenv Python under /root picks up /usr/lib's).
            return f"runs as Python {version.split()[0]} for other users, not as its own build"
        return None

    def open_box(self) -> SessionBox:
        """A fresh box for one interpreter (blocking: call it in a thread).

        Raises:
            CapacityReachedError: every uid of the range is leased on this host.
        """
        if not self.sandboxed:
            home = tempfile.mkdtemp(prefix="gym-repl-")
            limits = self.limits.prlimit_options(per_uid_processes=False)
            return UnsandboxedBox(home, limits, self.prlimit or None)
        for uid in self._uids_to_try():
            try:
                box = self._lease(uid)
            except OSError as exc:
                raise EnvError(f"cannot prepare sandbox uid {uid}: {exception_text(exc)}") from exc
            if box is not None:
                return box
        raise CapacityReachedError(
            f"all {len(self.uids)} sandbox uids are in use on this host; try again later"
        )

    def _uids_to_try(self) -> Iterator[int]:
        # From a random place: workers taking uids at once rarely contend for the same lock.
        start = random.randrange(len(self.uids))
        for offset in range(len(self.uids)):
            yield self.uids[(start + offset) % len(self.uids)]

    def _lease(self, uid: int) -> LeasedUidBox | None:
        """The box of ``uid`` if nobody holds it, cleaned of any previous holder's leftovers."""
        fd = self._lock(uid)
        if fd is None:
            return None
        try:
            if not self._clean(uid):
                os.close(fd)
                return None
            home = self._home(uid)
            os.mkdir(home, 0o700)
            os.chown(home, uid, uid)
        except BaseException:
            os.close(fd)
            raise
        return LeasedUidBox(uid, home, fd, self)

    def _home(self, uid: int) -> str:
        return os.path.join(self.homes_dir, str(uid))

    def _lock(self, uid: int) -> int | None:
        """An open descriptor holding ``uid``'s lock, or ``None`` if someone else holds it."""
        path = os.path.join(self.locks_dir, str(uid))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def _clean(self, uid: int) -> bool:
        """Kill ``uid``'s processes and remove its files (its lock held); False if some live on."""
        if not kill_processes_of_uid(uid, self.loop_children.snapshot()):
            logger.warning("sandbox uid %d: leftover processes do not die; skipped", uid)
            return False
        home = self._home(uid)
        if os.path.lexists(home):  # the last holder died before its teardown ended
            _remove_files_of_uid(uid)
            _remove_path(home)
        return True

    def sweep_abandoned(self) -> int:
        """Clean the uids whose holder died mid-lease; returns how many.

        A home directory whose lock nobody holds belongs to a worker that was
        killed: its interpreters died with it, but what they started with
        ``setsid`` may still run. Each worker sweeps when it starts, so the
        replacement of a killed worker cleans up after it.
        """
        if not self.sandboxed:
            return 0
        swept = 0
        for name in os.listdir(self.homes_dir):
            if not name.isdigit() or int(name) not in self.uids:
                continue
            fd = self._lock(int(name))
            if fd is None:
                continue  # a live lease
            try:
                swept += self._clean(int(name))
            finally:
                os.close(fd)
        return swept

    def become_reaper(self) -> None:
        """Adopt the sessions' orphans (sandboxed workers; see `become_child_subreaper`)."""
        if self.sandboxed and sys.platform.startswith("linux"):
            become_child_subreaper()

    def describe(self) -> dict[str, Any]:
        """The mode, interpreter, uid range and limits (for logs and benchmarks)."""
        return {
            "mode": self.mode,
            "python": self.python,
            "uids": [self.uids.start, self.uids.stop - 1] if self.sandboxed else None,
            "limits": self.limits.as_dict(),
        }
