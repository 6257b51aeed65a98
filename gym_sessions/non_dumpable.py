"""Make the current process non-dumpable, so other processes of its uid cannot read its memory.

Linux only: ``prctl(PR_SET_DUMPABLE, 0)``. A non-dumpable process's
``/proc/<pid>/environ``, ``mem``, ``maps``, ``fd`` and the like belong to root,
and attaching a debugger to it (``ptrace``) needs ``CAP_SYS_PTRACE``: a
process of the same uid without that capability reads neither its memory nor
its environment. Root (with its capabilities) still can.

What it costs: no core dumps, and ``py-spy``, ``gdb`` or ``strace -p`` need
root (``CAP_SYS_PTRACE``) to attach.

``execve`` resets the flag, so every process that holds the secret (the
supervisor and each worker) sets it for itself, as early as it can.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable

__all__ = ["is_dumpable", "make_process_non_dumpable"]

_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4


def _prctl() -> Callable[..., int]:
    libc = ctypes.CDLL(None, use_errno=True)
    prctl = libc.prctl
    # prctl is variadic in C; declared arguments keep the values full-width longs.
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def make_process_non_dumpable() -> bool:
    """Mark this process non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``).

    Returns:
        True once the process is non-dumpable; False where there is no such
        flag (not Linux), where this is a no-op.

    Raises:
        OSError: the kernel refused (never expected on Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    if _prctl()(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_DUMPABLE, 0) failed: {os.strerror(errno)}")
    return True


def is_dumpable() -> bool | None:
    """Whether this process is dumpable; None where there is no such flag (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    return _prctl()(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
