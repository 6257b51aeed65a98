"""A child process that dies with its parent: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``.

Workers used to watch their supervisor by polling ``getppid()`` from the
event loop's tick; on a busy machine that tick (and the graceful shutdown it
started) could lag by tens of seconds, and the orphans kept serving the public
port. With the death signal the kernel kills the worker the moment its
supervisor dies, whatever the load. multiprocessing's resource tracker then
sees its pipe's last writer gone and exits; a worker's own children (the
REPL's interpreters) carry the same signal for their worker.

Linux only; elsewhere `die_with_parent` does nothing and the tick's poll stays
the only watch.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent dies.

    Args:
        parent_pid: The parent this process was started by; if it already died
            (this process was reparented before the call) the process exits at once.

    Returns:
        True once the death signal is set; False where it cannot be (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    libc.prctl.restype = ctypes.c_int
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0) != 0:
        return False
    # The signal only covers a death after the call: one before it shows as a new parent.
    if os.getppid() != parent_pid:
        os._exit(1)
    return True
