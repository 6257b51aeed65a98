"""The child process of `envs.python_repl`: one persistent namespace, one request at a time.

Started by `envs.python_repl` as ``python -I -c BOOTSTRAP MARKER PARENT_PID``:
the bootstrap reads this file's source from stdin, ahead of the requests, so
the sandbox's users need not be able to read this file; the last argument is
the worker's pid. It reads JSON lines
``{"code": ...}`` and answers each with one JSON line
``{"stdout", "stderr", "value", "error"}``. The protocol moves to private
copies of fds 0 and 1 at start, and fds 0 and 1 are pointed at /dev/null and
fd 2, so ``input()``, ``os.write(1, ...)`` or a subprocess of the user's code
cannot read or corrupt it; every other inherited descriptor is closed. Only
this file's standard library imports run before the first request, so a fresh
interpreter starts quickly.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import linecache
import os
import signal
import sys
import traceback
from typing import Any, BinaryIO

OUTPUT_LIMIT = 1_000_000  # characters per field; keeps every reply line bounded


def _die_with_parent(parent_pid: int) -> None:
    """Best effort (Linux): a worker killed with SIGKILL takes its interpreters with it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _private_channels() -> tuple[BinaryIO, BinaryIO]:
    requests = os.fdopen(os.dup(0), "rb")  # os.dup's copies are not inherited by subprocesses
    replies = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    return requests, replies


def _close_inherited_fds(keep: set[int]) -> None:
    """Close every descriptor above 2 but ``keep``, before any of the user's code runs.

    The worker's event loop (uvloop) does not implement ``close_fds``, so the
    interpreter inherits every inheritable descriptor of its worker: the
    server's listening socket among them, on which the session's code could
    accept other clients' connections.
    """
    try:
        open_fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc (macOS): every number up to the limit
        open_fds = list(range(3, os.sysconf("SC_OPEN_MAX")))
    for fd in open_fds:
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):  # the listing's own descriptor, closed meanwhile
                os.close(fd)


def _clip(text: str) -> str:
    if len(text) > OUTPUT_LIMIT:
        text = f"{text[:OUTPUT_LIMIT]}\n... [{len(text) - OUTPUT_LIMIT} more characters]"
    # Lone surrogates cannot travel as UTF-8 JSON later on.
    return text.encode("utf-8", "replace").decode("utf-8")


def _format_error(exc: BaseException) -> str:
    """The traceback from the first frame of the user's code (this file's frames dropped)."""
    report = traceback.TracebackException.from_exception(exc)
    frames = list(report.stack)
    first = next((i for i, f in enumerate(frames) if f.filename.startswith("<cell")), len(frames))
    report.stack = traceback.StackSummary.from_list(frames[first:])
    text = "".join(report.format())
    if frames[first:] and not text.startswith("Traceback"):
        text = "Traceback (most recent call last):\n" + text
    return text


def _execute(code: str, namespace: dict[str, Any], filename: str) -> str | None:
    """Run ``code`` like a REPL cell: a trailing expression's value comes back as its repr."""
    tree = ast.parse(code, filename, "exec")
    last = tree.body[-1] if tree.body else None
    if isinstance(last, ast.Expr):
        tree.body.pop()
    else:
        last = None
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    value = eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
    if value is None:
        return None
    namespace["_"] = value
    return repr(value)


def run_cell(code: str, namespace: dict[str, Any], filename: str) -> dict[str, Any]:
    """One request: the code's captured output, its value and its traceback."""
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    stdout, stderr = io.StringIO(), io.StringIO()
    value = error = None
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            value = _execute(code, namespace, filename)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the cell failed
            error = _format_error(exc)
    return {
        "stdout": _clip(stdout.getvalue()),
        "stderr": _clip(stderr.getvalue()),
        "value": None if value is None else _clip(value),
        "error": None if error is None else _clip(error),
    }


def main() -> None:
    _die_with_parent(int(sys.argv[-1]) if len(sys.argv) > 1 else os.getppid())
    requests, replies = _private_channels()
    _close_inherited_fds({requests.fileno(), replies.fileno()})
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    for number, line in enumerate(requests, start=1):
        code = json.loads(line)["code"]
        reply = run_cell(code, namespace, f"<cell {number}>")
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


if __name__ == "__main__":
    main()
