"""Run ``gym-sessions serve`` as a child process: start it, wait until ready, stop it by PID.

This is the public way to start a server from Python (a notebook, a training
script); the demo, the tests and the benchmarks start theirs this way too::

    from gym_sessions.server import start_server

    with start_server("CartPole-v1", workers=4) as server:
        ...  # gymnasium.make("gym_sessions/Remote-v0", url=server.url)
 Each server gets its own short temporary directory as ``TMPDIR``, so
its runtime directory (claims and private sockets) is easy to find and Unix
socket paths stay under their length limit. A secret reaches the server in
its environment (``GYM_SESSIONS_SECRET``), never on its command line.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gym_sessions.runtime_dir import RuntimeDirectory
from gym_sessions.settings import SECRET_ENV

__all__ = ["ServerProcess", "live_parents", "start_server"]

_LISTENING = re.compile(r"on http://(\S+):(\d+) with")


@dataclass
class ServerProcess:
    """A running ``gym-sessions serve`` process.

    Attributes:
        process: The supervisor process.
        url: Base URL of the public listener.
        tmpdir: The server's ``TMPDIR``; its runtime directory lives inside.
        log_path: Where the server's stdout and stderr go.
    """

    process: subprocess.Popen[bytes]
    url: str
    tmpdir: str
    log_path: str
    owns_tmpdir: bool = False

    def runtime_dirs(self) -> list[str]:
        """Runtime directories of this server (one while it runs with several workers).

        Inside ``tmpdir``, or in /tmp when ``tmpdir`` is too long for socket paths.
        """
        return RuntimeDirectory.of_supervisor(self.process.pid, self.tmpdir)

    def _in_runtime_dirs(self, *parts: str) -> list[str]:
        return [p for d in self.runtime_dirs() for p in glob.glob(os.path.join(d, *parts))]

    def claim_files(self) -> list[str]:
        """Claim files currently in the runtime directory."""
        return [
            p
            for p in self._in_runtime_dirs("claims", "*")
            if not os.path.basename(p).startswith(".")
        ]

    def worker_sockets(self) -> list[str]:
        """Private sockets of the live (or killed) workers."""
        return self._in_runtime_dirs("workers", "*.sock")

    def worker_pids(self) -> list[int]:
        """PIDs of the supervisor's live worker processes (Linux ``/proc``)."""
        return sorted(
            pid
            for pid, parent in live_parents().items()
            if parent == self.process.pid and _is_worker(str(pid))
        )

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /health`` on a new connection."""
        with urllib.request.urlopen(self.url + "/health", timeout=timeout) as reply:
            return json.loads(reply.read())

    def log(self) -> str:
        """What the server printed so far."""
        with open(self.log_path, errors="replace") as file:
            return file.read()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server, SIGKILL it after ``timeout``; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self.owns_tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _is_worker(pid: str) -> bool:
    # The supervisor's children are its workers and multiprocessing's resource tracker.
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return b"resource_tracker" not in file.read()
    except OSError:
        return False


def live_parents() -> dict[int, int]:
    """The parent pid of every live (not zombie) process, from Linux ``/proc``."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the command name: state, then the parent's pid.
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    return parents


def start_server(
    target: str,
    *args: str,
    workers: int = 1,
    tmpdir: str | None = None,
    ready_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    secret: str | None = None,
    launcher: Sequence[str] = (),
) -> ServerProcess:
    """Start ``gym-sessions serve TARGET --port 0 --workers N ARGS`` and wait until it serves.

    ``secret`` (at least 32 characters) goes to the server as ``$GYM_SESSIONS_SECRET``.
    ``launcher`` is a command the server runs under, which must exec it in its
    own process (``setpriv ...``, say), so `ServerProcess.process` is the server.

    Ready means the listening line was printed, ``/health`` answers and, when
    routing with file claims, every worker's private socket exists. (With
    Redis claims workers register in Redis instead: callers that need every
    worker wait for those registrations.)

    Raises:
        RuntimeError: the server exited or did not become ready in time (with its log).
    """
    owns_tmpdir = tmpdir is None
    tmpdir = tmpdir or tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    os.makedirs(tmpdir, exist_ok=True)
    log_path = os.path.join(tmpdir, "server.log")
    command = [
        *launcher,
        sys.executable,
        "-m",
        "gym_sessions",
        "serve",
        target,
        "--port",
        "0",
        "--workers",
        str(workers),
        "--log-level",
        "warning",
        *args,
    ]
    child_env = {**os.environ, **(env or {}), "TMPDIR": tmpdir, "PYTHONUNBUFFERED": "1"}
    if secret is not None:
        child_env[SECRET_ENV] = secret
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_env)
    server = ServerProcess(process, "", tmpdir, log_path, owns_tmpdir)
    # With Redis claims workers listen on TCP, not on private sockets: callers
    # that need every worker wait for their registrations in Redis.
    file_routed = workers > 1 and "--no-routing" not in args and not _redis_claims(args)
    try:
        _wait_until_ready(server, workers if file_routed else 0, ready_timeout)
    except BaseException:
        server.stop()  # also when the caller is interrupted while waiting
        raise
    return server


def _redis_claims(args: tuple[str, ...]) -> bool:
    for flag, value in itertools.pairwise(args):
        if flag == "--claims":
            return value != "file"
    return any(arg.startswith("--claims=") and arg != "--claims=file" for arg in args)


def _wait_until_ready(server: ServerProcess, private_sockets: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"server exited early ({server.process.returncode}):\n{server.log()}"
            )
        match = _LISTENING.search(server.log())
        if match:
            server.url = f"http://{match.group(1)}:{match.group(2)}"
            try:
                server.health()
            except OSError:
                pass
            else:
                if len(server.worker_sockets()) >= private_sockets:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"server did not become ready in {timeout} s:\n{server.log()}")
