"""The server's runtime directory, shared by its workers (workers > 1 only).

``<tmp>/gym-sessions-<supervisor pid>-<random>/`` with ``claims/`` and
``workers/``, all mode 0700: claims and private sockets are closed to other
users. The supervisor creates it before the workers start and removes it when
the server exits, which also ends the claims of workers that died.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import tempfile

from gym_sessions.errors import StartupError

__all__ = [
    "SERVER_MARK",
    "SERVING",
    "STOPPING",
    "RuntimeDirectory",
    "process_exists",
    "worker_process_exists",
]

#: States of `RuntimeDirectory.mark`: a worker takes part in the server; it has
#: finished its own requests.
SERVING, STOPPING = "serving", "stopping"
#: The supervisor's mark (``server.stopping``): the whole server shuts down, so
#: workers wait for each other; a worker stopping alone waits for nobody.
SERVER_MARK = "server"

_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes on Linux, with the terminating NUL


_DIRECTORY_NAME = re.compile(r"gym-sessions-(\d+)-[A-Za-z0-9_]+")


def process_exists(pid: int) -> bool:
    """Whether a process ``pid`` exists (maybe another user's, maybe a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def worker_process_exists(worker_id: str) -> bool:
    """Whether the process of worker ``worker_id`` (``<pid>-<hex>``) may still run.

    ``True`` when the id names no pid (in-process test workers): a worker that
    cannot be shown gone is treated as alive, never taken over.
    """
    try:
        pid = int(worker_id.split("-", 1)[0])
    except ValueError:
        return True
    return process_exists(pid) and not _is_ending(pid)


# PF_EXITING in the kernel's flags word of /proc/<pid>/stat: the task is in exit().
_PF_EXITING = 0x4
_SIGKILL_BIT = 1 << (9 - 1)


def _is_ending(pid: int) -> bool:
    """A process that will run none of its code again: killed, exiting, or exited.

    A SIGKILLed worker first has the kill pending (on a loaded machine it may
    wait for a CPU), then tears itself down in the kernel (its sockets still
    accept for a moment), then stays a zombie until the supervisor reaps it;
    ``kill(pid, 0)`` succeeds all along. None of these runs Python again, so
    none serves a request or writes a claim: its sessions are gone. Linux
    only (``/proc``); elsewhere only a reaped process counts as ended.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
        with open(f"/proc/{pid}/status", "rb") as file:
            status = file.read()
    except FileNotFoundError:
        # Reaped since the caller saw it; but where there is no /proc at all,
        # nothing can be told.
        return os.path.isdir("/proc/self")
    except OSError:
        return False
    # The state follows the command name, which is in parentheses and may hold any byte.
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X", b"x") or int(fields[6]) & _PF_EXITING:
        return True
    for line in status.splitlines():
        if line.startswith((b"ShdPnd:", b"SigPnd:")) and int(line.split()[1], 16) & _SIGKILL_BIT:
            return True
    return False


def _too_long(base: str) -> bool:
    return len(os.fsencode(base)) + 60 > _MAX_SOCKET_PATH


class RuntimeDirectory:
    """Paths inside one server's runtime directory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.claims_dir = os.path.join(path, "claims")
        self.workers_dir = os.path.join(path, "workers")
        self.states_dir = os.path.join(path, "states")
        self.snapshots_dir = os.path.join(path, "snapshots")
        #: Balanced placement's load records (`FileLoadBoard` creates it).
        self.load_dir = os.path.join(path, "load")

    @classmethod
    def create(cls, base: str | None = None) -> RuntimeDirectory:
        """Create a fresh, private runtime directory under ``base`` (the system temp dir).

        Raises:
            StartupError: socket paths under ``base`` would exceed the Unix limit.
        """
        base = base or tempfile.gettempdir()
        # <base>/gym-sessions-<pid>-<8>/workers/<pid>-<8 hex>.sock must fit sun_path;
        # a long TMPDIR (macOS has one) falls back to /tmp.
        if _too_long(base):
            if _too_long("/tmp") or not os.access("/tmp", os.W_OK):
                raise StartupError(
                    f"temporary directory {base!r} is too long for Unix socket paths; "
                    "set TMPDIR to a shorter directory"
                )
            base = "/tmp"
        path = tempfile.mkdtemp(prefix=f"gym-sessions-{os.getpid()}-", dir=base)
        os.chmod(path, 0o700)
        directory = cls(path)
        os.mkdir(directory.claims_dir, 0o700)
        os.mkdir(directory.workers_dir, 0o700)
        os.mkdir(directory.states_dir, 0o700)
        os.mkdir(directory.snapshots_dir, 0o700)
        return directory

    @staticmethod
    def of_supervisor(pid: int, base: str | None = None) -> list[str]:
        """The runtime directories supervisor ``pid`` made under ``base``, or in /tmp
        where ``base`` was too long for socket paths (`create`'s fallback)."""
        base = base or tempfile.gettempdir()
        found: list[str] = []
        for root in dict.fromkeys((base, "/tmp")):
            found += glob.glob(os.path.join(root, f"gym-sessions-{pid}-*"))
        return found

    @staticmethod
    def remove_abandoned(base: str | None = None) -> list[str]:
        """Remove runtime directories under ``base`` whose supervisor is gone; returns them.

        A supervisor killed outright (SIGKILL) cannot remove its directory. Only
        directories of this user whose name's pid is no running process are
        removed (its workers exit within a second or two of their supervisor).
        """
        removed = []
        for root in {base or tempfile.gettempdir(), "/tmp"}:
            try:
                names = os.listdir(root)
            except OSError:
                continue
            for name in names:
                match = _DIRECTORY_NAME.fullmatch(name)
                path = os.path.join(root, name)
                if match is None or process_exists(int(match.group(1))):
                    continue
                try:
                    if os.lstat(path).st_uid != os.getuid():
                        continue
                except OSError:
                    continue
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def socket_path(self, worker_id: str) -> str:
        """The private socket of ``worker_id``."""
        return os.path.join(self.workers_dir, f"{worker_id}.sock")

    def handoff_path(self, worker_id: str) -> str:
        """The handoff socket of ``worker_id`` (`gym_sessions.routing.handoff_listener`)."""
        return os.path.join(self.workers_dir, f"{worker_id}.fds")

    def worker_ids(self) -> list[str]:
        """Ids of the workers whose private sockets exist (a killed worker's may linger)."""
        try:
            names = os.listdir(self.workers_dir)
        except FileNotFoundError:
            return []
        return [name[: -len(".sock")] for name in names if name.endswith(".sock")]

    def claim_count(self) -> int:
        """How many claims exist (for tests and diagnostics)."""
        return sum(1 for name in os.listdir(self.claims_dir) if not name.startswith("."))

    def snapshot_count(self) -> int:
        """How many sessions have a snapshot (for tests and diagnostics)."""
        try:
            names = os.listdir(self.snapshots_dir)
        except FileNotFoundError:
            return 0
        # A session's snapshot has two slot files (`FileSnapshotStore`).
        return len({name.rsplit(".", 1)[0] for name in names if not name.startswith(".")})

    def mark(self, worker_id: str, state: str, present: bool = True) -> None:
        """Record (or, with ``present=False``, forget) that ``worker_id`` is in ``state``.

        Workers of one server coordinate their shutdown through these marks
        (`gym_sessions.server.app.WorkerApp`): ``serving`` while a worker takes
        part in the server, ``stopping`` once it has finished its own requests.
        """
        path = os.path.join(self.states_dir, f"{worker_id}.{state}")
        if present:
            with open(path, "w"):
                pass
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def workers_in(self, state: str) -> set[str]:
        """Ids of the workers marked ``state`` (see `mark`)."""
        suffix = f".{state}"
        try:
            names = os.listdir(self.states_dir)
        except FileNotFoundError:
            return set()
        return {name[: -len(suffix)] for name in names if name.endswith(suffix)}

    def remove(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)
