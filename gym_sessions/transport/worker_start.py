"""How a supervisor starts its workers: forked from itself on Linux, spawned elsewhere.

uvicorn spawns each worker: a fresh interpreter that imports gym-sessions,
uvicorn, Starlette, Gymnasium and NumPy again (about 0.7 s of CPU per worker,
seconds beside busy workers), before it imports the target. The supervisor
has imported all of those already, so on Linux a worker is *forked* from it
instead and only imports the target: a 4-worker server starts about three
times sooner, and a reload or a replaced worker serves sooner too. The
process tree is the same (workers are the supervisor's children, so the
parent-death signal and the reaping do not change).

What a fork would otherwise carry over, and a spawned worker never had:

- **The target.** The supervisor never imports it: `check_in_child` loads
  and checks it in a short-lived forked child. Each worker imports it
  afresh, so a reload (SIGHUP) serves the code on disk now. gym-sessions'
  own modules and the libraries above are the supervisor's, as they are
  for the supervisor itself: upgrading those needs a restart.
- **Signal handlers** (and the wake-up fd): the supervisor's queue signals
  for its own loop. An at-fork hook puts Python's defaults back the moment
  a worker is forked, before anything else runs there (multiprocessing's
  bootstrap, and code it runs, may install a handler that chains to the one
  it finds). A SIGTERM sent before that, to a worker the supervisor has just
  forked (a shutdown right after a replacement), would be lost in the
  worker's copy of the queue and the supervisor would wait for that worker
  forever, so `fork_with_signals_held` forks with every signal blocked and
  `start_like_a_fresh_interpreter` unblocks them: a signal sent in between
  is delivered then, as a spawned worker would have got it.
- **NumPy's global random state**, which would be the same in every worker
  (Python's ``random`` reseeds itself after a fork): reseeded from the OS.
  Gymnasium envs seed their own generators, but an env that draws from
  ``np.random`` directly must not play the same episode on every worker.

The secret travels as before: it is in the config every worker gets, and a
fork keeps the supervisor's non-dumpable flag (only ``execve`` resets it).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from gym_sessions.errors import StartupError

__all__ = [
    "WORKERS_FORK",
    "check_in_child",
    "fork_context",
    "fork_with_signals_held",
    "start_like_a_fresh_interpreter",
]

#: Whether workers are forked from the supervisor (Linux) rather than spawned.
WORKERS_FORK = sys.platform.startswith("linux")

# The exit status of a `check_in_child` child whose check raised StartupError.
_REFUSED = 3
# The signal mask before `fork_with_signals_held` blocked every signal (the child's to restore).
_mask_before_fork: set[int | signal.Signals] | None = None
# The supervisor's Python-level signal handlers when it forked (the child's to undo).
_handlers_at_fork: dict[int, Any] = {}


def fork_context() -> Any:
    """The ``multiprocessing`` context that forks workers (where `WORKERS_FORK`)."""
    return multiprocessing.get_context("fork")


def fork_with_signals_held(start: Callable[[], None]) -> None:
    """Run ``start`` (which forks a worker) with every signal blocked in this thread.

    Signals that come meanwhile wait, and are delivered once ``start`` returns.
    """
    global _mask_before_fork
    _handlers_at_fork.clear()
    for signum in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(signum)
            if callable(handler) and handler is not signal.default_int_handler:
                _handlers_at_fork[signum] = handler
    before = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    _mask_before_fork = before
    try:
        start()
    finally:
        _handlers_at_fork.clear()  # the child has its copy (see `_undo_inherited_handlers`)
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _undo_inherited_handlers() -> None:
    # An at-fork hook, so it runs in the child before any other code there
    # (multiprocessing's bootstrap, and what it runs, may install a handler that
    # chains to the one it found: it must find the default, not the supervisor's).
    for signum, inherited in _handlers_at_fork.items():
        if signal.getsignal(signum) is inherited:
            fresh = signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL
            signal.signal(signum, fresh)
    _handlers_at_fork.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_undo_inherited_handlers)


def start_like_a_fresh_interpreter() -> None:
    """In a forked worker: undo what it inherited from the supervisor that a spawned one lacks.

    The supervisor's signal handlers are gone already (an at-fork hook put
    Python's defaults back the moment the worker was forked; a handler
    installed in the worker since stays). Last, the signals
    `fork_with_signals_held` blocked are unblocked: one that was sent to the
    worker meanwhile now has its default action (or the worker's own handler).
    """
    signal.set_wakeup_fd(-1)  # the supervisor's; asyncio sets the worker's own
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS, as a spawned worker's first use would be
    if _mask_before_fork is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, _mask_before_fork)


def check_in_child(check: Callable[..., None], *args: Any) -> None:
    """Run ``check(*args)`` in a forked child, so this process never imports what it loads.

    The child shares this process's stderr (its log lines and a traceback
    show there); a `StartupError` or ``ValueError`` it raises is raised here
    as a `StartupError` with its message.

    Raises:
        StartupError: the check refused, or failed (its traceback is above).
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's lines are measured in no process
        status = 1
        try:
            os.close(read_end)
            try:
                check(*args)
                status = 0
            except (StartupError, ValueError) as exc:  # what the command line reports in one line
                with os.fdopen(write_end, "wb") as pipe:
                    pipe.write(str(exc).encode())
                status = _REFUSED
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        message = pipe.read().decode(errors="replace")
    _, wait_status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(wait_status)
    if code == _REFUSED:
        raise StartupError(message)
    if code != 0:
        raise StartupError(f"the target could not be loaded (exit status {code}; see above)")
