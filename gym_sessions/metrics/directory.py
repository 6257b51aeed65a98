"""Where the workers of one server keep their metrics: ``<runtime dir>/metrics/``.

The workers record into prometheus_client's *multiprocess* files: each worker
process writes its own memory-mapped ``<kind>_<pid>.db`` files there, and the
worker that answers ``GET /metrics`` reads and adds up every file. A write is a
store into shared memory, so what a worker counted is visible to the others at
once, and it survives the worker (SIGKILL included): counters and histograms of
exited workers stay in the totals, which therefore never go backwards. Gauges
are written in a ``live`` mode instead (``gauge_livesum_<pid>.db``): the files of
a process that is gone are removed before each read (`forget_exited_workers`),
so gauges describe the live workers only.

prometheus_client picks multiprocess mode from ``$PROMETHEUS_MULTIPROC_DIR``
when it is first imported, so the supervisor sets it (`export`) before it
starts any worker and every worker inherits it; a worker forked from a
supervisor that imported prometheus_client earlier picks the mode again
(`record_here`). The directory lives and dies
with the runtime directory (mode 0700, removed when the server exits).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re

from gym_sessions.runtime_dir import process_exists

__all__ = ["MULTIPROC_ENV", "MetricsDirectory"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_GAUGE_FILE = re.compile(r"gauge_live[a-z]+_(\d+)\.db")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie (a killed worker not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        return process_exists(pid)  # no /proc here: existence is all we can tell


class MetricsDirectory:
    """The metrics files of one server's workers."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def of(cls, runtime_dir: str) -> MetricsDirectory:
        """The metrics directory inside ``runtime_dir``."""
        return cls(os.path.join(runtime_dir, "metrics"))

    def create(self) -> None:
        """Make the directory (mode 0700, like the rest of the runtime directory)."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)

    def export(self) -> None:
        """Make every process started from now on record into this directory."""
        os.environ[MULTIPROC_ENV] = self.path

    def unexport(self) -> None:
        """Undo `export` (the server stopped; its directory is about to go)."""
        if os.environ.get(MULTIPROC_ENV) == self.path:
            del os.environ[MULTIPROC_ENV]

    @property
    def active(self) -> bool:
        """Whether this process records into this directory (it inherited `export`)."""
        return os.environ.get(MULTIPROC_ENV) == self.path

    def record_here(self) -> None:
        """Make this process's metrics go to the directory (an `active` one), not to its memory.

        For a worker forked from its supervisor, before its first metric: it
        inherited prometheus_client as the supervisor imported it, maybe
        before `export`, in single-process mode. Picking the mode again is
        what a fresh import would have done.
        """
        from prometheus_client import values

        if not getattr(values.ValueClass, "_multiprocess", False):
            values.ValueClass = values.get_value_class()

    def forget_pid(self, pid: int) -> None:
        """Remove the live-gauge files of process ``pid`` (gone, or a pid now reused)."""
        from prometheus_client.multiprocess import mark_process_dead

        # Another worker answering /metrics at the same moment may remove them first.
        with contextlib.suppress(FileNotFoundError):
            mark_process_dead(pid, self.path)

    def forget_exited_workers(self) -> list[int]:
        """Remove the live-gauge files of processes that are gone; returns their pids.

        Their counters and histograms stay: they are part of the totals.
        """
        gone = set()
        for path in glob.glob(os.path.join(self.path, "gauge_live*_*.db")):
            match = _LIVE_GAUGE_FILE.fullmatch(os.path.basename(path))
            if match is not None and not _running(int(match.group(1))):
                gone.add(int(match.group(1)))
        for pid in gone:
            self.forget_pid(pid)
        return sorted(gone)
