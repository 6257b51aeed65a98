"""A Python interpreter per session: an example resources server with one tool, ``run_code``.

Each session owns one long-lived ``python`` child process, started by the
session's first ``run_code`` call (no session start needed: the cookie of
that first reply names the session). A session start (``/seed_session`` or
``/reset``) discards the session's interpreter, if any, so a started session
always begins with empty variables; the next call starts a fresh one. (A
repeated ``/seed_session`` of an open session returns it as it is: the base
does not run the start hook again; ``/reset`` does.)
Variables persist between calls: ``x = 41`` then ``print(x + 1)`` prints 42.

- ``run_code {code, timeout?}`` returns ``{stdout, stderr, value, error}``:
  the code's output, the repr of a trailing expression's value (or null) and
  the traceback of an exception it raised (or null). Calls of one session run
  one at a time; sessions never wait on each other.
- A call longer than its timeout (default 10 s, at most 60) kills the
  interpreter and fails with ``env_error``; so does an interpreter that exits
  (``os._exit(3)``). Either way the session's next call starts a fresh one.
- ``/verify {expected_stdout?}`` scores 1.0 when the stdout of the session's
  last answered call (not one that timed out or crashed) equals
  ``expected_stdout`` (from the verify body, else from the session start's
  task data), else 0.0.
- The interpreter is killed when the session is closed, verified without
  ``x-gym-close-follows: 1``, or its claim ends (the window after the last
  request of a session that was never started or already ended), and when the
  worker stops. ``/health`` shows the live interpreters as ``sessions``.
- A worker runs at most ``max_interpreters`` interpreters (default 64): a call
  that would start one more fails with 503 ``capacity_reached`` and starts
  nothing, so calls without a cookie cannot pile up interpreters.

Where the code runs (`envs.repl_sandbox` has the mechanics):

**Sandboxed** (the server runs as root, the default for containers and CI):
each interpreter runs under a uid of its own, leased from ``uids`` (default
2000000000-2000004095) for that interpreter's life only, with ``prlimit``
resource limits and no capabilities (``setpriv --no-new-privs``). Protected:

- the worker's and the supervisor's environment (the server secret), memory,
  open files and the runtime directory: another uid cannot read
  ``/proc/<pid>/{environ,mem,maps,fd}`` of root's processes, nor
  ``pidfd_getfd`` or ptrace them, nor enter the 0700 runtime directory;
- the worker, the supervisor and every other session's processes against
  signals (``os.kill``), ``/proc/<pid>/mem`` reads and writes and
  ``pidfd_getfd`` (each session has another uid);
- the host against one session's memory, CPU time, processes, open files and
  file size (the limits, defaults below; the process limit counts all of the
  session's processes);
- leftovers: at the end of the interpreter every process of its uid is
  killed, ``setsid`` and double-fork escapes included, its private directory
  (cwd, ``HOME``, ``TMPDIR``) and its files in ``/tmp``, ``/var/tmp`` and
  ``/dev/shm`` are removed, and only then is the uid released.

Not protected: the code can read whatever any user may read (world-readable
files, including this repository, and every process's ``cmdline``: do not
pass ``--secret`` on the command line, use ``GYM_SESSIONS_SECRET``); it has
the host's network (it can reach the server's public port like any client,
and whatever else is reachable); memory is limited per process, not per
session (up to ``processes`` x ``address_space_bytes``); disk use is bounded
per file only, while the interpreter lives; SysV IPC objects it creates
outlive it. There is no mount, network or PID namespace (bubblewrap would
add those where user namespaces work).

**Unsandboxed** (``--unsandboxed``; a server that is not root refuses to start
without it): the code runs as the server's own user. Each interpreter still
gets a private temporary directory (removed at its end), a clean environment
(no ``GYM_SESSIONS_*`` variables, no secret in it) and the limits except the
process limit (which would count all of the server user's processes). Nothing
else is protected: the code can read the worker's environment and memory
through ``/proc`` (the secret, other sessions' cookies), signal or ptrace
every process of the server (other sessions' interpreters, the worker, the
supervisor), and leave processes started with ``setsid`` running after its
session ends. Serve it so only to clients you trust.

The interpreter is ``python`` if given, else the worker's own Python when an
unprivileged user can run it (so the code sees the server's packages), else
``/usr/local/bin/python3`` or ``/usr/bin/python3`` (standard library only).
It is started with ``-I`` (no ``PYTHON*`` variables, no user site, no current
directory on ``sys.path``) and a short bootstrap with ``-c`` that reads the
child's source from its stdin, so neither the repository nor the virtualenv
needs to be readable by the sandbox users.

Settings are keyword arguments (serve a configured instance as
``module:attr``)::

    # myrepl.py
    from gym_sessions.examples.python_repl import PythonReplServer
    REPL = PythonReplServer(max_interpreters=16, address_space_bytes=2 * 1024**3)
    # gym-sessions serve myrepl:REPL --workers 4

The child (`envs._python_repl_child`) captures what the code writes to
``sys.stdout`` and ``sys.stderr``; writes straight to fds 1 and 2 (a
subprocess's output, say) are discarded, and ``input()`` sees end of file. It
runs in its own process group and, on Linux, dies with its worker.

Serve it with ``gym-sessions serve envs.python_repl:PythonReplServer --workers 4``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request

from gym_sessions.errors import (
    CapacityReachedError,
    EnvError,
    InvalidRequestError,
    SessionClosedError,
    StartupError,
    exception_text,
)
from gym_sessions.server import BodySchema, Field, ResourcesServer, Tool, session_id
from gym_sessions.settings import Settings

from .repl_sandbox import (
    DEFAULT_STATE_DIR,
    DEFAULT_UIDS,
    GIB,
    MIB,
    ReplSandbox,
    ResourceLimits,
    SessionBox,
)

__all__ = ["CHILD_MARKER", "Interpreter", "PythonReplServer"]

logger = logging.getLogger("gym_sessions.python_repl")

CHILD_SCRIPT = Path(__file__).with_name("_python_repl_child.py")
# The child's source travels down its stdin, so the sandbox's users need not be able
# to read the repository: "<length>\n<source>", read by `CHILD_BOOTSTRAP` (``-c``)
# without buffering, so the requests that follow stay unread for the child.
CHILD_SOURCE = CHILD_SCRIPT.read_bytes()
CHILD_PAYLOAD = b"%d\n%s" % (len(CHILD_SOURCE), CHILD_SOURCE)
CHILD_BOOTSTRAP = """\
import os
def read_exactly(size):
    data = b""
    while len(data) < size:
        chunk = os.read(0, size - len(data))
        if not chunk:
            raise SystemExit(1)
        data += chunk
    return data
header = b""
while not header.endswith(b"\\n"):
    header += read_exactly(1)
exec(compile(read_exactly(int(header)), "_python_repl_child.py", "exec"))
"""
# An argument of every interpreter's command line, so tools can tell them apart.
CHILD_MARKER = "gym-sessions-repl-child"
DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 60.0
DEFAULT_MAX_INTERPRETERS = 64
_REPLY_LIMIT = 32 * 1024 * 1024  # the child clips each field to 1e6 characters
_EXIT_GRACE = 5.0  # how long to wait for the exit code of an interpreter that hung up

RUN_CODE_ARGUMENTS = BodySchema(
    {
        "code": Field(("string",), required=True, description="Python source to run"),
        "timeout": Field(
            ("number",),
            description=f"seconds before the interpreter is killed (default {DEFAULT_TIMEOUT:g})",
            schema={
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": MAX_TIMEOUT,
                "default": DEFAULT_TIMEOUT,
            },
        ),
    }
)


async def _open_box(sandbox: ReplSandbox) -> SessionBox:
    """``sandbox.open_box()`` in a thread; a box opened after a cancellation is closed."""
    future = asyncio.get_running_loop().run_in_executor(None, sandbox.open_box)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:

        def close_orphan(done: asyncio.Future[SessionBox]) -> None:
            if not done.cancelled() and done.exception() is None:
                done.result().close()

        future.add_done_callback(close_orphan)
        raise


def _log_teardown_failure(done: asyncio.Future[None]) -> None:
    if not done.cancelled() and done.exception() is not None:
        logger.error("closing a sandbox failed", exc_info=done.exception())


class Interpreter:
    """A child Python process, its box and its JSON-lines channel (`envs._python_repl_child`)."""

    def __init__(self, process: asyncio.subprocess.Process, box: SessionBox) -> None:
        self.process = process
        self.box = box
        self.killed = False
        self.reaped: asyncio.Future[int] | None = None  # done once the event loop reaped it

    @classmethod
    async def start(cls, sandbox: ReplSandbox) -> Interpreter:
        """A fresh interpreter with an empty namespace, in a fresh box of ``sandbox``.

        Raises:
            CapacityReachedError: no sandbox uid is free on this host.
            EnvError: the interpreter could not be started.
        """
        box = await _open_box(sandbox)
        program = [sandbox.python, "-I", "-c", CHILD_BOOTSTRAP, CHILD_MARKER, str(os.getpid())]
        try:
            process = await asyncio.create_subprocess_exec(
                *box.command(program),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=box.environment(),
                cwd=box.home,
                start_new_session=True,  # its own process group: kill() reaches its subprocesses
                limit=_REPLY_LIMIT,
            )
        except BaseException as exc:
            _close_box(box, wait=False)
            if isinstance(exc, OSError):
                raise EnvError(f"cannot start a Python interpreter: {exception_text(exc)}") from exc
            raise
        interpreter = cls(process, box)
        interpreter.reaped = _watch_exit(process, sandbox)
        assert process.stdin is not None
        process.stdin.write(CHILD_PAYLOAD)  # sent ahead of the first request
        return interpreter

    async def run(self, code: str, time_limit: float) -> dict[str, Any]:
        """Run ``code`` and return the child's reply.

        Raises:
            EnvError: ``time_limit`` seconds passed, or the interpreter exited;
                either way it is dead and must not be used again.
        """
        assert self.process.stdin is not None and self.process.stdout is not None
        try:
            async with asyncio.timeout(time_limit):
                self.process.stdin.write(json.dumps({"code": code}).encode() + b"\n")
                await self.process.stdin.drain()
                line = await self.process.stdout.readline()
        except TimeoutError:
            self.kill()
            raise EnvError(
                f"run_code timed out after {time_limit:g} s; the interpreter was killed and its "
                "variables are lost (the next call starts a fresh one)"
            ) from None
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        except RuntimeError:  # uvloop: the channel's transport is closed
            if self.killed:
                line = b""
            else:
                self.kill()
                raise EnvError(
                    "the interpreter's channel broke; it was killed and its variables are lost "
                    "(the next call starts a fresh one)"
                ) from None
        except ValueError as exc:  # a reply line over the limit
            self.kill()
            raise EnvError(f"the interpreter's reply was too large: {exc}") from exc
        except BaseException:
            self.kill()  # cancelled or worse: the channel is out of step, so it cannot be reused
            raise
        if not line:
            raise await self._exited()
        try:
            return json.loads(line)
        except ValueError as exc:
            self.kill()
            raise EnvError(f"the interpreter sent a malformed reply: {exc}") from exc

    async def _exited(self) -> EnvError:
        if self.killed:
            return EnvError("the session was closed while run_code ran; its interpreter was killed")
        try:
            code = await asyncio.wait_for(self.process.wait(), _EXIT_GRACE)
        except TimeoutError:
            self.kill()
            return EnvError("the interpreter closed its channel and was killed")
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        return EnvError(
            f"the interpreter {how} while running the code; its variables are lost "
            "(the next call starts a fresh one)"
        )

    def kill(self, *, wait: bool = False) -> None:
        """SIGKILL the interpreter's process group now, then close its box; idempotent.

        Closing the box (every process of a sandboxed session's uid, its files)
        runs in a thread unless ``wait`` or no event loop runs; safe to call
        from sync code.
        """
        if self.killed:
            return
        self.killed = True
        if self.process.returncode is None:
            # Not reaped yet, so the pid is still this process's (not a reused one).
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
        _close_box(self.box, wait=wait)


def _watch_exit(process: asyncio.subprocess.Process, sandbox: ReplSandbox) -> asyncio.Future[int]:
    """Keep ``process`` out of the sandbox's reaping until the event loop has reaped it."""
    sandbox.loop_children.add(process.pid)
    waiter = asyncio.ensure_future(process.wait())
    waiter.add_done_callback(lambda _: sandbox.loop_children.discard(process.pid))
    return waiter


def _close_box(box: SessionBox, *, wait: bool) -> None:
    """Close ``box`` now (``wait``, or no event loop) or in a worker thread."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        wait = True
    if wait:
        box.close()
    else:
        loop.run_in_executor(None, box.close).add_done_callback(_log_teardown_failure)


class _SessionLocks:
    """One `asyncio.Lock` per session, kept only while someone holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._locks[key]


class PythonReplServer(ResourcesServer):
    """A persistent Python interpreter per session, driven by the ``run_code`` tool.

    Args:
        max_interpreters: Live interpreters per worker (default 64); past it a
            call that needs a new one gets 503 ``capacity_reached``.
        address_space_bytes: ``RLIMIT_AS`` per process (default 1 GiB).
        cpu_seconds: ``RLIMIT_CPU`` per process (default 300).
        processes: ``RLIMIT_NPROC`` of a session's uid (default 64; sandboxed only).
        open_files: ``RLIMIT_NOFILE`` per process (default 256).
        file_size_bytes: ``RLIMIT_FSIZE`` (default 128 MiB).
        uids: The sandbox's uids, one per live interpreter on the host (default
            ``range(2_000_000_000, 2_000_004_096)``); no user or group may have one.
        sandbox_dir: Root-owned directory of the uid locks and the sessions'
            homes (default ``/run/gym-sessions-repl``); shared by every server
            of the host that uses the same uids.
        python: The interpreter to run (default: picked, see the module docs).

    Each limit may be ``None`` (unlimited). Values that cannot work raise
    `ValueError`.
    """

    def __init__(
        self,
        *,
        max_interpreters: int = DEFAULT_MAX_INTERPRETERS,
        address_space_bytes: int | None = 1 * GIB,
        cpu_seconds: int | None = 300,
        processes: int | None = 64,
        open_files: int | None = 256,
        file_size_bytes: int | None = 128 * MIB,
        uids: range = DEFAULT_UIDS,
        sandbox_dir: str = DEFAULT_STATE_DIR,
        python: str | None = None,
    ) -> None:
        if isinstance(max_interpreters, bool) or not isinstance(max_interpreters, int):
            raise ValueError(f"max_interpreters must be an integer, not {max_interpreters!r}")
        if max_interpreters < 1:
            raise ValueError(f"max_interpreters must be at least 1, not {max_interpreters}")
        limits = ResourceLimits(
            address_space_bytes=address_space_bytes,
            cpu_seconds=cpu_seconds,
            processes=processes,
            open_files=open_files,
            file_size_bytes=file_size_bytes,
        )
        self.max_interpreters = max_interpreters
        self.sandbox = ReplSandbox(limits, uids, sandbox_dir, python)
        self._children: dict[str, Interpreter] = {}
        self._starting = 0
        self._locks = _SessionLocks()
        self._last_stdout: dict[str, str] = {}
        self._expected_stdout: dict[str, str] = {}

    def check_settings(self, settings: Settings) -> None:
        """Refuse to start unsandboxed unless told to, or with a sandbox that cannot work."""
        self.sandbox.configure(settings.unsandboxed)
        self.sandbox.sweep_abandoned()  # what an earlier server left running when it was killed
        if self.sandbox.sandboxed and len(self.sandbox.uids) < settings.workers * (
            self.max_interpreters
        ):
            raise StartupError(
                f"uids holds {len(self.sandbox.uids)} uids, fewer than workers x "
                f"max_interpreters = {settings.workers * self.max_interpreters}"
            )

    def configure(self, settings: Settings) -> None:
        self.sandbox.configure(settings.unsandboxed)
        self.sandbox.become_reaper()
        swept = self.sandbox.sweep_abandoned()  # what a killed worker left running
        logger.info("python_repl: %s; %d abandoned uids cleaned", self.sandbox.describe(), swept)

    def tools(self) -> list[Tool]:
        return [
            Tool(
                "run_code",
                "Run Python code in this session's interpreter; variables persist between "
                "calls. Returns stdout, stderr, the repr of a trailing expression's value "
                "(or null) and the traceback of an uncaught exception (or null).",
                RUN_CODE_ARGUMENTS,
                self._run_code,
            )
        ]

    def metrics(self) -> dict[str, Any]:
        return {"sessions": len(self._children)}

    async def _run_code(self, request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
        timeout = float(arguments.get("timeout", DEFAULT_TIMEOUT))
        if not 0 < timeout <= MAX_TIMEOUT:
            raise InvalidRequestError(f"timeout must be in (0, {MAX_TIMEOUT:g}] seconds")
        sid = session_id(request)
        async with self._locks.hold(sid):
            if sid in self.closed:  # closed while this call waited for the one before it
                raise SessionClosedError(f"session {sid!r} is closed")
            interpreter = self._children.get(sid)
            if interpreter is None:
                interpreter = await self._start_interpreter()
                if sid in self.closed:  # closed while the interpreter started
                    interpreter.kill()
                    raise SessionClosedError(f"session {sid!r} is closed")
                self._children[sid] = interpreter
            try:
                reply = await interpreter.run(arguments["code"], timeout)
            except BaseException:
                if self._children.get(sid) is interpreter:
                    del self._children[sid]
                interpreter.kill()  # dead already; this ends what it left running
                raise
        self._last_stdout[sid] = reply["stdout"]
        return {key: reply[key] for key in ("stdout", "stderr", "value", "error")}

    async def _start_interpreter(self) -> Interpreter:
        """A new interpreter, unless this worker runs as many as it may (503 then)."""
        if len(self._children) + self._starting >= self.max_interpreters:
            raise CapacityReachedError(
                f"this worker runs {self.max_interpreters} interpreters, its limit: close a "
                "session or try again later"
            )
        self._starting += 1
        try:
            return await Interpreter.start(self.sandbox)
        finally:
            self._starting -= 1

    async def start_session(self, session_id: str, body: dict[str, Any], path: str) -> dict:
        expected = body.get("expected_stdout")
        if expected is not None and not isinstance(expected, str):
            raise InvalidRequestError("expected_stdout must be a string")
        async with self._locks.hold(session_id):
            self.release_session(session_id)
        if expected is not None:
            self._expected_stdout[session_id] = expected
        return {}

    async def verify_session(self, session_id: str, body: dict[str, Any]) -> dict:
        expected = body.get("expected_stdout", self._expected_stdout.get(session_id))
        stdout = self._last_stdout.get(session_id)
        correct = expected is not None and stdout == expected
        return {"reward": 1.0 if correct else 0.0, "stdout": stdout, "expected_stdout": expected}

    def release_session(self, session_id: str) -> None:
        self._discard(session_id)
        self._last_stdout.pop(session_id, None)
        self._expected_stdout.pop(session_id, None)

    def release_all(self) -> None:
        # The worker is stopping: close every box now, not in threads that may not finish.
        for sid in list(self._children):
            interpreter = self._children.pop(sid)
            interpreter.kill(wait=True)
            self.release_session(sid)

    def _discard(self, session_id: str) -> None:
        interpreter = self._children.pop(session_id, None)
        if interpreter is not None:
            interpreter.kill()
