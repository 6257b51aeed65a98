"""A Python interpreter per session: an example resources server with one tool, ``run_code``.

This is an example of per-session state that lives outside the worker (a
child process), NOT a security sandbox: the code runs with the server's
privileges, can read its files, open sockets and start processes. Serve it
only to clients you trust, on a loopback or private address.

Each session owns one long-lived ``python`` child process, started by the
session's first ``run_code`` call (no session start needed: the cookie of
that first reply names the session). A session start (``/seed_session`` or
``/reset``) discards the session's interpreter, if any, so a started session
always begins with empty variables; the next call starts a fresh one.
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

The child (`envs._python_repl_child`) captures what the code writes to
``sys.stdout`` and ``sys.stderr``; writes straight to fds 1 and 2 (a
subprocess's output, say) are discarded, and ``input()`` sees end of file.
It runs in its own process group, killed as a whole, without the worker's
``GYM_SESSIONS_*`` environment (the server secret), and on Linux it dies with
its worker.

Serve it with ``gym-sessions serve envs.python_repl:PythonReplServer --workers 4``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.requests import Request

from gym_sessions.errors import EnvError, InvalidRequestError, SessionClosedError
from gym_sessions.server.bodies import BodySchema, Field
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool

__all__ = ["Interpreter", "PythonReplServer"]

CHILD_SCRIPT = Path(__file__).with_name("_python_repl_child.py")
DEFAULT_TIMEOUT = 10.0
MAX_TIMEOUT = 60.0
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


def _child_environment() -> dict[str, str]:
    # The worker's settings (its secret included) are not the user code's business.
    return {k: v for k, v in os.environ.items() if not k.startswith("GYM_SESSIONS")}


class Interpreter:
    """One child Python process and its JSON-lines channel (see `envs._python_repl_child`)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.killed = False

    @classmethod
    async def start(cls) -> Interpreter:
        """A fresh interpreter with an empty namespace."""
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(CHILD_SCRIPT),
                str(os.getpid()),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                env=_child_environment(),
                start_new_session=True,  # its own process group: kill() reaches its subprocesses
                limit=_REPLY_LIMIT,
            )
        except OSError as exc:
            raise EnvError(f"cannot start a Python interpreter: {exc}") from exc
        return cls(process)

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

    def kill(self) -> None:
        """SIGKILL the interpreter and its process group now; safe to call from sync code."""
        self.killed = True
        if self.process.returncode is not None:
            return  # reaped already: its pid may belong to another process by now
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except OSError:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()


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
    """A persistent Python interpreter per session, driven by the ``run_code`` tool."""

    def __init__(self) -> None:
        self._children: dict[str, Interpreter] = {}
        self._locks = _SessionLocks()
        self._last_stdout: dict[str, str] = {}
        self._expected_stdout: dict[str, str] = {}

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
                interpreter = await Interpreter.start()
                if sid in self.closed:  # closed while the interpreter started
                    interpreter.kill()
                    raise SessionClosedError(f"session {sid!r} is closed")
                self._children[sid] = interpreter
            try:
                reply = await interpreter.run(arguments["code"], timeout)
            except BaseException:
                if self._children.get(sid) is interpreter:
                    del self._children[sid]
                raise
        self._last_stdout[sid] = reply["stdout"]
        return {key: reply[key] for key in ("stdout", "stderr", "value", "error")}

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
        for sid in list(self._children):
            self.release_session(sid)

    def _discard(self, session_id: str) -> None:
        interpreter = self._children.pop(session_id, None)
        if interpreter is not None:
            interpreter.kill()
