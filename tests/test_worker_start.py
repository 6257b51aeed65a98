"""How workers start (`gym_sessions.transport.worker_start`), with real forks.

A forked worker must look like a spawned one where it matters: Python's
default signal handlers, a NumPy global generator of its own; and the
target's check runs in a child, so this process never imports the target
and gets the child's refusal as its own `StartupError`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from gym_sessions.errors import StartupError
from gym_sessions.transport.worker_start import (
    check_in_child,
    fork_context,
    fork_with_signals_held,
    start_like_a_fresh_interpreter,
)

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")


def _run_and_send(body: Callable[[], object], write_end: int) -> None:
    with os.fdopen(write_end, "w") as pipe:
        json.dump(body(), pipe)


def in_fork(body: Callable[[], object]) -> object:
    """``body()``'s JSON-able result, computed in a worker forked as the supervisor forks one."""
    read_end, write_end = os.pipe()
    child = fork_context().Process(target=_run_and_send, args=(body, write_end))
    fork_with_signals_held(child.start)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        result = json.load(pipe)
    child.join(30)
    return result


@pytest.fixture
def supervisor_handlers() -> Iterator[None]:
    """Handlers as uvicorn's supervisor installs them (queueing the signal), restored after."""
    signals = [signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGINT, signal.SIGUSR1]
    before = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, lambda signum, frame: None)
    signal.signal(signal.SIGQUIT, signal.SIG_IGN)
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def test_a_forked_worker_gets_pythons_default_handlers_back(supervisor_handlers):
    def handlers() -> dict[str, str]:
        start_like_a_fresh_interpreter()
        shown = {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}
        return {
            signal.Signals(signum).name: shown.get(handler, getattr(handler, "__name__", "?"))
            for signum in (signal.SIGHUP, signal.SIGTTIN, signal.SIGTTOU, signal.SIGUSR1)
            for handler in [signal.getsignal(signum)]
        } | {
            "SIGINT": signal.getsignal(signal.SIGINT).__name__,
            "SIGQUIT": shown[signal.getsignal(signal.SIGQUIT)],
        }

    assert in_fork(handlers) == {
        "SIGHUP": "default",
        "SIGTTIN": "default",
        "SIGTTOU": "default",
        "SIGUSR1": "default",
        "SIGINT": "default_int_handler",  # KeyboardInterrupt, as in a fresh interpreter
        "SIGQUIT": "ignored",  # an ignored signal stays ignored, as across exec
    }


def _worker_slow_to_restore_defaults() -> None:
    time.sleep(0.5)  # a SIGTERM is sent in this window, while the supervisor's handler is here
    start_like_a_fresh_interpreter()
    time.sleep(10)


def test_a_sigterm_sent_before_the_defaults_are_back_still_ends_the_worker(supervisor_handlers):
    queued: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: queued.append(signum))
    try:
        worker = fork_context().Process(target=_worker_slow_to_restore_defaults)
        fork_with_signals_held(worker.start)
        os.kill(worker.pid, signal.SIGTERM)  # at once, as a shutdown right after a replacement
        worker.join(30)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert worker.exitcode == -signal.SIGTERM  # held until the default was back, then delivered
    assert queued == []  # and this process's own handler saw nothing
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # unblocked here again


def test_a_handler_the_worker_installed_after_the_fork_stays(supervisor_handlers):
    def handler_after_reset() -> str:
        signal.signal(signal.SIGHUP, _own_handler)  # as an at-fork hook of a library would
        start_like_a_fresh_interpreter()
        return getattr(signal.getsignal(signal.SIGHUP), "__name__", "?")

    assert in_fork(handler_after_reset) == "_own_handler"


def _own_handler(signum: int, frame: object) -> None:
    pass


def test_forked_workers_draw_their_own_numpy_global_numbers():
    np.random.seed(7)

    def draws() -> list[float]:
        start_like_a_fresh_interpreter()
        return np.random.random(4).tolist()

    first, second = in_fork(draws), in_fork(draws)
    inherited = np.random.random(4).tolist()  # what a child without the reseed would draw
    assert first != second
    assert inherited not in (first, second)


def _import_and_check(module: str) -> None:
    __import__(module)


def _refuse(message: str) -> None:
    raise StartupError(message)


def _bad_value(message: str) -> None:
    raise ValueError(message)


def _crash(message: str) -> None:
    raise RuntimeError(message)


def test_the_check_imports_in_the_child_only():
    module = "tabnanny"  # in the standard library, imported by nothing here
    assert module not in sys.modules
    check_in_child(_import_and_check, module)
    assert module not in sys.modules


@pytest.mark.parametrize("check", [_refuse, _bad_value])
def test_a_refusal_in_the_child_is_raised_here_with_its_message(check):
    with pytest.raises(StartupError) as raised:
        check_in_child(check, "target 'nowhere:Env' cannot be imported: no module 'nowhere'")
    assert str(raised.value) == "target 'nowhere:Env' cannot be imported: no module 'nowhere'"


def test_a_crash_in_the_child_is_a_startup_error_pointing_at_its_traceback(capfd):
    with pytest.raises(StartupError, match=r"exit status 1; see above"):
        check_in_child(_crash, "the env's module failed")
    assert "RuntimeError: the env's module failed" in capfd.readouterr().err


# Both ways a worker gets its config, in a fresh interpreter each.
CONFIG_IN_A_WORKER = """
import os, pickle, sys, tempfile
from gym_sessions.metrics.directory import MetricsDirectory
from gym_sessions.non_dumpable import is_dumpable
from gym_sessions.server.worker import WorkerConfig, WorkerSpec
from gym_sessions.settings import Settings

runtime_dir = tempfile.mkdtemp()
directory = MetricsDirectory.of(runtime_dir)
directory.create()
directory.export()
import prometheus_client.values as values
assert not values.ValueClass._multiprocess  # imported before export, as in a supervisor
config = WorkerConfig(WorkerSpec("CartPole-v1", Settings(runtime_dir=runtime_dir)))
if sys.argv[1] == "spawned":
    config = pickle.loads(pickle.dumps(config))  # what a spawned worker reads from its pipe
    assert is_dumpable() is False, "a spawned worker is non-dumpable as it reads its config"
config.started_in_worker()
picked = values.ValueClass
assert picked._multiprocess, "the worker records into the server's files"
directory.record_here()
assert values.ValueClass is picked, "a mode already right is left as it is"
print("ok")
"""


@pytest.mark.parametrize("how", ["spawned", "forked"])
def test_a_workers_config_sets_it_up_either_way(how):
    done = subprocess.run(
        [sys.executable, "-c", CONFIG_IN_A_WORKER, how],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "ok", done.stderr
