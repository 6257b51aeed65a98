"""A worker that ends with its supervisor, its sessions' processes included.

Workers used to watch their supervisor by polling ``getppid()`` from the
event loop's tick; on a busy machine that tick (and the graceful shutdown it
started) could lag by tens of seconds, and the orphans kept serving the public
port. Now each worker asks the kernel for a death signal
(``prctl(PR_SET_PDEATHSIG)``), delivered the moment its supervisor dies,
whatever the load.

The signal is `DEATH_SIGNAL`, not SIGKILL: a SIGKILLed worker could not end
what its sessions started (the REPL's interpreters and the processes they
detached), and nobody else would. Its handler runs in the main thread at the
next bytecode, without waiting for the event loop: it arms a kernel alarm
(`EXIT_WITHIN` seconds; SIGALRM's default action ends the process should the
clean-up hang), runs the clean-ups the worker registered (`on_parent_death`,
in order: close its copy of the public socket, release every session), and
exits. The signal's default action, before the
handler is in place, ends the process too.

Linux only; elsewhere `die_with_parent` does nothing and the tick's poll stays
the only watch.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType

__all__ = ["DEATH_SIGNAL", "EXIT_WITHIN", "die_with_parent", "on_parent_death"]

logger = logging.getLogger("gym_sessions.supervisor")

#: The signal the kernel sends a worker when its supervisor dies (no uvicorn use).
DEATH_SIGNAL = signal.SIGUSR2
#: Seconds an orphaned worker has for its clean-up before the kernel ends it: the
#: REPL sandbox may take 5 s to see every process of a stubborn session gone.
EXIT_WITHIN = 10

_PR_SET_PDEATHSIG = 1
_cleanups: list[Callable[[], None]] = []


def on_parent_death(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` (synchronous, quick) when the supervisor dies, after those added before."""
    _cleanups.append(cleanup)


def _exit_orphaned(signum: int, frame: FrameType | None) -> None:
    signal.alarm(EXIT_WITHIN)
    logger.warning("worker %d: supervisor gone, releasing sessions and exiting", os.getpid())
    for cleanup in _cleanups:
        try:
            cleanup()
        except Exception:  # one failed clean-up must not keep the others from running
            logger.exception("clean-up after the supervisor's death failed")
    os._exit(1)


def die_with_parent(parent_pid: int) -> bool:
    """End this process, after its clean-ups, as soon as its parent dies.

    Args:
        parent_pid: The parent this process was started by; if it already died
            (this process was reparented before the call) the process exits at once.

    Returns:
        True once the death signal is set; False where it cannot be (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    signal.signal(DEATH_SIGNAL, _exit_orphaned)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    if libc.prctl(_PR_SET_PDEATHSIG, DEATH_SIGNAL, 0, 0) != 0:
        return False
    # The signal only covers a death after the call: one before it shows as a new parent.
    if os.getppid() != parent_pid:
        os._exit(1)
    return True
