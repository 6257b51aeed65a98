"""The multi-worker supervisor: uvicorn's, with drains where uvicorn drops sessions.

uvicorn's ``Multiprocess`` replaces every worker on SIGHUP and removes one on
SIGTTOU by terminating it, and each terminated worker takes its sessions with
it. Here a worker that has to go *drains*: it stops accepting connections on
the shared socket, takes no new session (a start that still reaches it, on a
kept-alive connection, is placed on another worker), and keeps serving its
open sessions, reached through the routing rule like any session, until the
last one is closed or expires, or ``drain_timeout`` passes; then it exits as on
SIGTERM.

Signals to the supervisor:

- SIGTERM, SIGINT: every worker shuts down gracefully (requests already
  received, forwarded ones included, run to their reply within
  ``--graceful-timeout``; then sessions are released); a second SIGINT kills
  the workers at once.
- SIGHUP: zero-downtime reload. A new generation of workers (importing the
  target afresh) starts; once it serves, the old generation drains.
- SIGTTIN: one worker more. SIGTTOU: one worker fewer, drained (never below one).

Workers die with their supervisor: each asks the kernel for a death signal
as it starts (`gym_sessions.transport.parent_death`), so a supervisor's SIGKILL
ends every worker at once, on a busy machine too, after it released its
sessions (their processes included), and with them the multiprocessing
resource tracker (its pipe's last writers). Off Linux, a worker polls its
parent from the event loop's tick and shuts down within about a second. A worker that dies or stops
answering the health check is replaced by a worker of this kind too (uvicorn's
own loop would start its plain one, which neither drains nor takes handed-over
connections).

The app a worker serves is a `SupervisedApp` (`gym_sessions.server.WorkerApp`):
what a drain, a supervisor's death and handed-over connections need of it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import pickle
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn import Server
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors.multiprocess import Multiprocess, Process

from gym_sessions.runtime_dir import SERVER_MARK, STOPPING, RuntimeDirectory
from gym_sessions.transport.http_protocol import TESTED_UVICORN, BoundedHttpProtocol
from gym_sessions.transport.parent_death import die_with_parent, on_parent_death
from gym_sessions.transport.worker_start import (
    WORKERS_FORK,
    fork_context,
    fork_with_signals_held,
    start_like_a_fresh_interpreter,
)

__all__ = ["DRAIN_SIGNAL", "DrainableServer", "SupervisedApp", "Supervisor", "worker_app"]

logger = logging.getLogger("gym_sessions.supervisor")

#: Sent by the supervisor to a worker that must drain.
DRAIN_SIGNAL = signal.SIGUSR1
# How long past its drain timeout (plus the graceful timeout) a draining worker
# may take before the supervisor kills it.
_DRAIN_GRACE_SECONDS = 10.0
# An orphaned worker gives its requests this long before it releases its sessions.
_ORPHAN_GRACE_SECONDS = 1


class SupervisedApp(abc.ABC):
    """What a worker's `DrainableServer` asks of the ASGI app it serves."""

    worker_id: str

    @property
    @abc.abstractmethod
    def drain_timeout(self) -> float:
        """Seconds a draining worker may keep serving its open sessions."""

    @property
    @abc.abstractmethod
    def open_sessions(self) -> int:
        """Sessions open here now."""

    @property
    @abc.abstractmethod
    def takes_handed_connections(self) -> bool:
        """Whether other workers may hand this one client connections."""

    @abc.abstractmethod
    def serve_handed_connections(
        self, new_protocol: Callable[[], Any], accepting: Callable[[], bool]
    ) -> None:
        """Serve handed-over connections with ``new_protocol()`` while ``accepting()``."""

    @abc.abstractmethod
    def begin_drain(self) -> None:
        """Take no new session here; serve the open ones on."""

    @abc.abstractmethod
    async def drained(self) -> None:
        """Return once no open session needs this worker."""

    @abc.abstractmethod
    def leave_server(self) -> None:
        """This worker leaves alone (drained, orphaned): nobody waits for it at shutdown."""

    @abc.abstractmethod
    def release_sessions(self) -> None:
        """Release every session's resources now (the supervisor died)."""


class DrainableServer(Server):
    """A worker's uvicorn server that can drain, and that dies with its supervisor."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._supervisor_pid = os.getppid()
        self._drain_task: asyncio.Task[None] | None = None

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(DRAIN_SIGNAL, self.begin_drain)
        app = worker_app(self.config.loaded_app)
        if app is not None:
            on_parent_death(app.release_sessions)
        self._serve_handed_connections()

    def _serve_handed_connections(self) -> None:
        """Let the app serve connections other workers hand over, as this server's own."""
        app = worker_app(self.config.loaded_app)
        if app is None or not app.takes_handed_connections:
            return
        config, state, app_state = self.config, self.server_state, self.lifespan.state
        protocol_class: Any = config.http_protocol_class
        cls = getattr(protocol_class, "func", protocol_class)  # a functools.partial
        if not (isinstance(cls, type) and issubclass(cls, BoundedHttpProtocol)):
            logger.warning(
                "worker %s: connection handoff off (the HTTP protocol is not gym-sessions')",
                app.worker_id,
            )
            return
        if not cls.handoff_enabled:
            logger.warning(
                "worker %s: connection handoff off (uvicorn %s is not a tested version; tested: "
                "%s): requests are forwarded, replies written as uvicorn writes them",
                app.worker_id,
                uvicorn.__version__,
                ", ".join(f"{major}.{minor}" for major, minor in TESTED_UVICORN),
            )
            return

        def new_protocol() -> Any:
            return protocol_class(config=config, server_state=state, app_state=app_state)

        app.serve_handed_connections(
            new_protocol, lambda: not self.should_exit and self._drain_task is None
        )

    def begin_drain(self) -> None:
        """Stop accepting connections and new sessions; exit when the open sessions are done."""
        if self._drain_task is not None:
            return
        for server in self.servers:
            server.close()  # this worker's copy of the shared socket: others keep accepting
        app = worker_app(self.config.loaded_app)
        seconds = app.drain_timeout if app is not None else 0.0
        self._drain_task = asyncio.ensure_future(self._drain(app, seconds))

    async def _drain(self, app: SupervisedApp | None, seconds: float) -> None:
        if app is not None:
            app.begin_drain()
            try:
                async with asyncio.timeout(seconds):
                    await app.drained()
            except TimeoutError:
                logger.warning(
                    "worker %s: drain timeout (%g s) with %d open sessions; closing them",
                    app.worker_id,
                    seconds,
                    app.open_sessions,
                )
        if app is not None:
            app.leave_server()
        self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        # Orphaned (the supervisor was killed): exit now, releasing sessions and
        # their child processes, rather than serve on where nobody supervises.
        if counter % 5 == 0 and os.getppid() != self._supervisor_pid:
            if not self.should_exit:
                logger.warning("supervisor %d is gone: shutting down", self._supervisor_pid)
                app = worker_app(self.config.loaded_app)
                if app is not None:
                    app.leave_server()
            self.should_exit = True
            # Quick, but through the lifespan shutdown, which releases the
            # sessions (env.close(), the REPL's interpreters).
            self.config.timeout_graceful_shutdown = _ORPHAN_GRACE_SECONDS
        return await super().on_tick(counter)


def worker_app(app: Any) -> SupervisedApp | None:
    """The `SupervisedApp` inside uvicorn's middleware around a loaded app, or ``None``."""
    for _ in range(8):
        if isinstance(app, SupervisedApp):
            return app
        app = getattr(app, "app", None)
    return None


class _WorkerProcess(Process):
    """uvicorn's worker process, serving with a `DrainableServer`, dying with its supervisor.

    Forked rather than spawned on Linux (`gym_sessions.transport.worker_start`).
    A config with a ``started_in_worker()`` method has it called first thing
    in the worker, before the app is built.
    """

    def __init__(self, config: Any, sockets: list[Any]) -> None:
        # Read here, in the supervisor: the worker compares its parent with it.
        self.supervisor_pid = os.getpid()
        super().__init__(config, sockets)
        if WORKERS_FORK:
            # uvicorn's spawned child, forked instead: the same function and arguments.
            spawned: Any = self.process
            self.process = fork_context().Process(
                target=spawned._target, args=spawned._args, kwargs=spawned._kwargs
            )

    def start(self) -> None:
        if WORKERS_FORK:
            fork_with_signals_held(super().start)
        else:
            super().start()

    def target(self, sockets: list[Any] | None = None) -> None:
        if WORKERS_FORK:
            start_like_a_fresh_interpreter()

        # An orphan first stops taking connections on the public port, then
        # releases its sessions (registered once the app has started).
        def close_public_socket() -> None:
            for sock in sockets or ():
                sock.close()

        on_parent_death(close_public_socket)
        die_with_parent(self.supervisor_pid)
        started_in_worker = getattr(self.config, "started_in_worker", None)
        if started_in_worker is not None:
            started_in_worker()
        super().target(sockets)

    @property
    def server(self) -> Server:
        if self._server is None:
            self._server = DrainableServer(config=self.config)
        return self._server

    def wait_until_ready(self, timeout: float, should_exit: threading.Event | None = None) -> bool:
        """Whether the worker serves within ``timeout`` s; False as soon as it exits or we stop.

        uvicorn's reads one health-check answer per ping, oldest first. A spawned
        worker answers only once it has imported our modules (about 0.7 s of CPU,
        seconds on a loaded machine) and one ping a second waits meanwhile; it
        then answers them all "not started", and each later check read an answer
        that many pings old (0.1 s apart), so a reload could kill new workers
        that had started in time. Here each check goes by the newest answer.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if should_exit is not None and should_exit.is_set():
                return False
            if not self.process.is_alive():
                return False
            if self._newest_answer(1.0):
                return True
            time.sleep(0.1)
        return False

    def _newest_answer(self, timeout: float) -> bool:
        """Ping; whether the newest answer waiting (within ``timeout`` s) says it started."""
        try:
            self.parent_conn.send(b"ping")
            if not self.parent_conn.poll(timeout):
                return False
            started = self.parent_conn.recv()
            while self.parent_conn.poll(0):
                started = self.parent_conn.recv()
        except (OSError, EOFError, pickle.UnpicklingError):
            return False
        return started is True


@dataclass
class _Draining:
    process: Process
    kill_at: float


class Supervisor(Multiprocess):
    """uvicorn's ``Multiprocess`` with drains on SIGHUP and SIGTTOU and a hard second SIGINT.

    Args:
        config: The workers' config (`gym_sessions.server.worker.WorkerConfig`).
        sockets: The shared listening socket(s).
        drain_timeout: Seconds a draining worker may keep open sessions.
        start_timeout: Seconds a reload's new workers may take to serve.
    """

    def __init__(
        self,
        config: Any,
        sockets: list[Any],
        drain_timeout: float,
        start_timeout: float = 120.0,
    ) -> None:
        super().__init__(config, sockets)
        self.drain_timeout = drain_timeout
        self.start_timeout = start_timeout
        self.draining: list[_Draining] = []
        self._interrupts = 0
        # uvicorn's loop looks at its queued signals every 0.5 s: a signal also
        # writes a byte here (at C level), so SIGTERM or SIGHUP is acted on at once.
        self._wakeup_read, wakeup_write = os.pipe()
        for end in (self._wakeup_read, wakeup_write):
            os.set_blocking(end, False)
        signal.set_wakeup_fd(wakeup_write, warn_on_full_buffer=False)

    def _new_process(self) -> Process:
        process = _WorkerProcess(self.config, self.sockets)
        process.start()
        return process

    def init_processes(self) -> None:
        for _ in range(self.processes_num):
            self.processes.append(self._new_process())

    # Signals -----------------------------------------------------------------------------

    def handle_int(self) -> None:
        self._interrupts += 1
        if self._interrupts > 1:
            logger.warning("second SIGINT: stopping every worker now")
            self._kill_all()
        else:
            logger.info("SIGINT: workers finish their requests, then exit (again to force)")
        self.should_exit.set()

    def handle_hup(self) -> None:
        logger.info("SIGHUP: starting new workers; the current ones drain")
        fresh = [self._new_process() for _ in self.processes]
        # Not the 5 s health check uvicorn waits: a spawned worker imports the
        # target first, which takes longer than that beside busy workers (a
        # reload under load was given up) or with heavy envs. Health checks
        # start once the new workers serve.
        deadline = time.monotonic() + self.start_timeout
        if not all(
            p.wait_until_ready(max(0.0, deadline - time.monotonic()), self.should_exit)
            for p in fresh
        ):
            logger.error(
                "new workers were not serving within %g s (--worker-start-timeout): "
                "keeping the current ones",
                self.start_timeout,
            )
            for process in fresh:
                process.kill()
                process.join()
            return
        old, self.processes = self.processes, fresh
        for process in old:
            self._drain(process)

    def handle_ttin(self) -> None:
        logger.info("SIGTTIN: one worker more")
        self.processes.append(self._new_process())

    def handle_ttou(self) -> None:
        if len(self.processes) <= 1:
            logger.info("SIGTTOU: one worker left, keeping it")
            return
        logger.info("SIGTTOU: one worker fewer (it drains)")
        self._drain(self.processes.pop())

    def _drain(self, process: Process) -> None:
        if process.pid is None or process.exitcode is not None:
            return
        graceful = self.config.timeout_graceful_shutdown or 0
        kill_at = time.monotonic() + self.drain_timeout + graceful + _DRAIN_GRACE_SECONDS
        self.draining.append(_Draining(process, kill_at))
        os.kill(process.pid, DRAIN_SIGNAL)

    # Running -----------------------------------------------------------------------------

    def _replace_dead_workers(self) -> None:
        """Replace each worker that exited or stopped answering the health check.

        uvicorn's own loop replaces them with its plain worker process, whose
        server neither drains, watches its supervisor nor serves handed-over
        connections: here the replacement is one of ours.
        """
        if self.should_exit.is_set():
            return
        for index, process in enumerate(self.processes):
            if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                continue
            process.kill()  # hung: it must not serve on beside its replacement
            process.join()
            if process.exitcode == STARTUP_FAILURE:
                # It failed before serving: a replacement would fail the same way.
                logger.error("worker [%s] failed to start: stopping the server", process.pid)
                self.should_exit.set()
                return
            if self.should_exit.is_set():
                return
            logger.info("worker [%s] died: starting a replacement", process.pid)
            self.processes[index] = self._new_process()

    def keep_subprocess_alive(self) -> None:
        self._replace_dead_workers()
        now = time.monotonic()
        for entry in list(self.draining):
            process = entry.process
            if process.exitcode is not None:
                process.join()
                self.draining.remove(entry)
                logger.info("drained worker [%s] exited", process.pid)
            elif now >= entry.kill_at:
                logger.error("drained worker [%s] did not exit: killing it", process.pid)
                process.kill()

    def run(self) -> None:
        logger.info("supervisor [%d] started", os.getpid())
        self.init_processes()
        while not self.should_exit.is_set():
            if select.select([self._wakeup_read], [], [], 0.5)[0]:
                os.read(self._wakeup_read, 4096)
            self.handle_signals()
            self.keep_subprocess_alive()
        everyone = [*self.processes, *(entry.process for entry in self.draining)]
        self._mark_server_stopping()
        for process in everyone:
            process.terminate()
        # Wait for the graceful shutdowns; a second SIGINT ends them at once.
        while any(p.exitcode is None for p in everyone):
            if signal.SIGINT in self.signal_queue:
                self.signal_queue.clear()
                self.handle_int()
            for process in everyone:
                process.process.join(0.1)
        for process in everyone:
            process.join()

    def _mark_server_stopping(self) -> None:
        """Tell the workers the whole server stops: they wait for each other's requests."""
        runtime_dir = getattr(getattr(self.config, "spec", None), "settings", None)
        path = getattr(runtime_dir, "runtime_dir", None)
        if path is not None:
            RuntimeDirectory(path).mark(SERVER_MARK, STOPPING)

    def _kill_all(self) -> None:
        for process in [*self.processes, *(entry.process for entry in self.draining)]:
            if process.exitcode is None:
                process.process.kill()
