"""Says which ``gym_sessions`` a benchmark's server process imported (never used by the product).

Benchmarks that run several revisions side by side put this folder on the
server's ``PYTHONPATH`` with ``GYM_BENCH_PROBE_DIR`` set (``_common.start_revision_server``).
Python imports ``sitecustomize`` at start-up in every process, workers spawned
by multiprocessing included; a daemon thread then waits for ``gym_sessions``
to be imported and writes ``<GYM_BENCH_PROBE_DIR>/<pid>.json`` with its
``__file__``, then ends. A forked process (workers on Linux) runs no
start-up and inherits no thread: an at-fork hook starts its own. Without the
variable it does nothing.
"""

import functools
import json
import os
import sys
import threading
import time

_DIRECTORY = os.environ.get("GYM_BENCH_PROBE_DIR")


def _report(directory: str) -> None:
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        module = sys.modules.get("gym_sessions")
        path = getattr(module, "__file__", None)
        if path:
            record = {"pid": os.getpid(), "ppid": os.getppid(), "gym_sessions": path}
            temporary = os.path.join(directory, f".{os.getpid()}.tmp")
            with open(temporary, "w") as file:
                json.dump(record, file)
            os.replace(temporary, os.path.join(directory, f"{os.getpid()}.json"))
            return
        time.sleep(0.05)


def _start(directory: str) -> None:
    threading.Thread(target=_report, args=(directory,), daemon=True, name="probe").start()


if _DIRECTORY:
    _start(_DIRECTORY)
    os.register_at_fork(after_in_child=functools.partial(_start, _DIRECTORY))
