"""A client process stopped with SIGTERM closes its sessions, as one stopped with Ctrl-C does.

SIGTERM is what ``kill``, Slurm and Kubernetes send. Python's default for it
ends the process at once: no ``finally``, no exit handlers, so every session
would stay open on the server until its idle timeout. Ctrl-C instead raises
``KeyboardInterrupt``, the stack unwinds and the exit closes the sessions
(`gym_sessions.client.lifecycle`, and a `RemoteVectorEnv`'s own close).

So while a client holds an open session, and only where SIGTERM still has
Python's default, `hold` puts a handler in its place that raises
``SystemExit(143)`` in the main thread (128 + SIGTERM, the status a shell
reports for a process SIGTERM ended): the stack unwinds as on Ctrl-C, quietly
(``SystemExit`` prints no traceback), and the exit closes the sessions. The
handler puts the default back before it raises, so a second SIGTERM (or one
during the exit's closes) ends the process at once, as before. Inside a
running event loop (`AsyncRemoteEnv`, a vector env's step) it raises from a
callback of that loop instead, at once: between callbacks every task waits
at an ``await``, so the unwinding never starts halfway through a step's code.

Python drops an exception raised where it cannot propagate: in a finalizer
(an ``HTTPResponse`` closed as it is collected, a ``__del__``, a weakref
callback) it only prints "Exception ignored". A SIGTERM that lands there
would leave the loop running with the default handler back, so the handler
also remembers it came, and `stop_if_terminated`, called by every reset and
step, raises the ``SystemExit`` again in the main thread.

Left alone, always:

- a handler of the application's own, installed before or after the first
  session (it decides what SIGTERM means; an exit through ``sys.exit``
  closes the sessions anyway, and one that chains to the handler it replaced
  reaches this one), ``SIG_IGN``, and a handler installed outside Python;
- clients used only from other threads than the main one: Python lets only
  the main thread set a handler;
- a forked child that inherited the handler: it dies by the signal, as it
  would have without it (its parent's sessions are not its own).

`release` puts the default back when the last held client closes, and so
does the collection of the last one left open (in the main thread), if the
handler is still this one; a SIGTERM that finds no client held is handed to
the default at once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import weakref
from types import FrameType

__all__ = ["EXIT_STATUS", "exit_if_pending", "hold", "release", "stop_if_terminated"]

#: The exit status of a client process that SIGTERM stopped (as a shell reports it).
EXIT_STATUS = 128 + signal.SIGTERM

# Clients with an open session, by id; weak, so a collected client stops counting.
_held: dict[int, weakref.ref[object]] = {}
_lock = threading.Lock()
# The process whose handler this is (a forked child inherits it, not the pid).
_installed_by: int | None = None
# The process whose handler raised SystemExit (which a finalizer may have swallowed).
_terminated: int | None = None
# The process whose handler scheduled SystemExit on a running loop (not raised yet).
_pending: int | None = None


def hold(owner: object) -> None:
    """``owner`` has (or is starting) a session: SIGTERM now ends the process as Ctrl-C does."""
    key = id(owner)
    if _installed_by == os.getpid() and key in _held:
        return
    with _lock:
        if key not in _held:
            _held[key] = weakref.ref(owner, lambda _: _collected(key))
        if _installed_by != os.getpid() and threading.current_thread() is threading.main_thread():
            _install()


def release(owner: object) -> None:
    """``owner``'s sessions are closed; the last one out puts SIGTERM's default back."""
    with _lock:
        _held.pop(id(owner), None)
        if not _held and threading.current_thread() is threading.main_thread():
            _uninstall()


def stop_if_terminated() -> None:
    """Raise ``SystemExit(143)`` again if this process's SIGTERM handler already raised it.

    Called by each reset and step: it ends a loop whose first ``SystemExit``
    a finalizer swallowed. Only in the main thread, where the handler raised it.
    """
    global _terminated
    pid = os.getpid()
    if pid in (_terminated, _pending) and threading.current_thread() is threading.main_thread():
        # A SystemExit scheduled on a loop that stopped before it ran is raised here.
        _terminated = pid
        raise SystemExit(EXIT_STATUS)


def exit_if_pending() -> None:
    """Raise the ``SystemExit(143)`` a SIGTERM scheduled on a loop that stopped first.

    For code that runs a loop to completion and returns (a vector env's step):
    called right after, so the exit comes at the end of the interrupted call,
    not at the start of a later run (the exit's own closes). Never twice.
    """
    global _terminated
    pid = os.getpid()
    main = threading.current_thread() is threading.main_thread()
    if _pending == pid and _terminated != pid and main:
        _terminated = pid
        raise SystemExit(EXIT_STATUS)


def _collected(key: int) -> None:
    # At garbage collection, maybe inside `hold` in this thread: no lock.
    _held.pop(key, None)
    if not _held and threading.current_thread() is threading.main_thread():
        _uninstall()


def _install() -> None:
    global _installed_by
    current = signal.getsignal(signal.SIGTERM)
    if current is signal.SIG_DFL or current is _on_sigterm:  # inherited by a fork: ours too
        signal.signal(signal.SIGTERM, _on_sigterm)
        _installed_by = os.getpid()


def _uninstall() -> None:
    global _installed_by
    if _installed_by == os.getpid() and signal.getsignal(signal.SIGTERM) is _on_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _installed_by = None


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _installed_by, _terminated, _pending
    # No lock here: the main thread may hold it where the signal came in.
    ours = _installed_by == os.getpid()
    signal.signal(signum, signal.SIG_DFL)
    _installed_by = None
    if not ours or not _held:
        os.kill(os.getpid(), signum)  # ends the process as the default would
        return
    loop = _running_loop()
    if loop is not None:
        # Inside a running event loop (an async client, a vector env's step): raise
        # from one of its callbacks, where every task waits at an ``await``, not
        # at whatever bytecode the signal interrupted (a coroutine made and never
        # awaited, a reply half read), as asyncio.run does for Ctrl-C. If the loop
        # stops first, `exit_if_pending` or `stop_if_terminated` raises it.
        _pending = os.getpid()
        loop.call_soon_threadsafe(_exit)
        return
    _terminated = os.getpid()
    raise SystemExit(EXIT_STATUS)


def _exit() -> None:
    global _terminated
    if _terminated == os.getpid():
        return  # raised already (`stop_if_terminated`): the exit's own closes run on
    _terminated = os.getpid()
    raise SystemExit(EXIT_STATUS)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
