"""What a server process runs: the app of one target with its settings.

The supervisor (``gym-sessions serve``) builds one `WorkerConfig`, a uvicorn
``Config`` that carries the target and the settings (the secret and the
runtime directory included). Each worker, replacements of dead workers too,
is forked from the supervisor with that config in its memory (Linux), or
spawned and handed it pickled through a pipe (elsewhere,
`gym_sessions.transport.worker_start`): the secret is never in a worker's
environment, in its command line or in a file. Every worker is non-dumpable
before it holds the config (a forked one keeps the supervisor's flag, a
spawned one sets it as it unpickles the config), so other processes of its
uid cannot read it back from the worker's memory. With one worker the
supervisor serves the same config in-process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from gym_sessions.metrics.directory import MetricsDirectory
from gym_sessions.non_dumpable import make_process_non_dumpable
from gym_sessions.server.app import create_app
from gym_sessions.server.targets import load_target
from gym_sessions.settings import Settings

__all__ = ["HEADLESS_SDL", "WorkerConfig", "WorkerSpec", "build_app"]

#: SDL's drivers in a worker where unset: a served env renders its frames off
#: screen (pygame for CartPole's ``rgb_array``) and never opens a window or plays
#: a sound there, so SDL needs no desktop session and prints no warning for its
#: absence (``XDG_RUNTIME_DIR is invalid or not set``, once per env).
HEADLESS_SDL = {"SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy"}


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one server serves.

    Attributes:
        target: A registered Gymnasium id or ``module:attr`` (see `load_target`).
        settings: The server's settings, the secret included.
    """

    target: str
    settings: Settings  # its repr leaves the secret out


def build_app(spec: WorkerSpec) -> Callable[..., Any]:
    """The ASGI app serving ``spec.target`` with ``spec.settings`` in this process."""
    for name, value in HEADLESS_SDL.items():
        os.environ.setdefault(name, value)  # before the target (and pygame) is imported
    served = load_target(spec.target)
    if callable(served) and not hasattr(served, "bind"):
        return served  # an ASGI app served as it is
    return create_app(served, spec.settings)


class WorkerConfig(uvicorn.Config):
    """A uvicorn ``Config`` whose app is built from a `WorkerSpec` it carries.

    uvicorn pickles its config into every worker it starts, so the spec
    travels with it and a replacement worker gets the same one.
    """

    def __init__(self, spec: WorkerSpec, **options: Any) -> None:
        # The factory uvicorn calls (``factory=True``) in each worker: picklable, as
        # `build_app` is a module-level function and the spec a frozen dataclass.
        super().__init__(functools.partial(build_app, spec), factory=True, **options)
        self.spec = spec

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Runs only when a spawned worker unpickles the config uvicorn sent it:
        # the earliest point where gym-sessions code runs there, before the app
        # is built and before any request. execve reset the flag the supervisor
        # set, so the worker sets its own (a forked worker kept it).
        make_process_non_dumpable()
        self.__dict__.update(state)

    def started_in_worker(self) -> None:
        """Called first in each worker, forked or spawned, before the target is imported."""
        _record_into_the_servers_metrics(self.spec.settings)


def _record_into_the_servers_metrics(settings: Settings) -> None:
    """Make this worker record into the server's metrics files, before its first metric exists.

    Whichever way the worker started (`record_here`), the env's own metrics
    included. And a worker whose pid an exited worker of this server had must not show
    that one's gauges: prometheus_client names its files by pid and would
    reopen the earlier process's live-gauge file (its worker would look
    alive) if no scrape removed it in between.
    """
    if settings.runtime_dir is not None:
        directory = MetricsDirectory.of(settings.runtime_dir)
        if directory.active:
            directory.record_here()
            directory.forget_pid(os.getpid())
