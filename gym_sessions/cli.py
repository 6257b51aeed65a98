"""The ``gym-sessions`` command: ``serve``, ``reload``, ``status`` of a server, and the ``demo``.

Every string shown by ``--help`` is plain text (no reStructuredText markup):
``tests/e2e/test_cli.py`` checks it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gym_sessions.errors import StartupError, StatusError
from gym_sessions.non_dumpable import make_process_non_dumpable
from gym_sessions.secret_source import (
    COMMAND_LINE_SECRET_REFUSAL,
    read_secret_file,
    server_secret,
)
from gym_sessions.settings import SECRET_ENV, Settings
from gym_sessions.wire import WS_ENVELOPE_BYTES

__all__ = ["main"]

EXIT_STARTUP_FAILURE = 2
#: ``status`` could not read the server's page (unreachable, refused).
EXIT_STATUS_FAILURE = 1

DESCRIPTION = (
    "Serve Gymnasium environments over HTTP from several worker processes, each session "
    "routed to the worker that holds it."
)

SERVE_EPILOG = """\
TARGET is a registered Gymnasium id (CartPole-v1) or module:attr naming an Env
class, an env factory, a ResourcesServer, or an ASGI app. A module is imported
from the current directory too. --env-kwargs '{"size": 8}' passes keyword
arguments to the Env class, the factory or gymnasium.make of every session.

With --workers > 1 every request of a session is routed to the worker that
created the session (over that worker's private Unix socket), so per-session
state is safe with any number of workers. --no-routing turns that off: only
for servers that keep no per-session state.

Several hosts behind one load balancer: run the same command on each host with
--claims redis://HOST:PORT/DB, one secret for all (--secret-file or
$GYM_SESSIONS_SECRET), and --private-host set to an address the other hosts
can reach; requests between hosts are signed.

An agent server (envs.counter_agent:CounterAgent, say) calls only the env and model
servers it is started with: --allow-env URL (or NAME=URL) for each env server
its /run bodies may name, --allow-model likewise for model servers. A body
names one by NAME or by its exact URL; anything else gets 400
forbidden_target and no connection is made (docs/security.md).

The secret never goes on the command line (every user can read that): put it
in a file only you can read, at least 32 characters on one line, and pass
--secret-file PATH:

  umask 077; python -c 'import secrets; print(secrets.token_hex(32))' > secret
"""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def _make_non_dumpable() -> None:
    """Keep processes of this uid out of this process's memory (it holds the secret)."""
    try:
        make_process_non_dumpable()
    except OSError as exc:
        raise StartupError(f"cannot protect the server's memory: {exc}") from exc


def serve(
    target: str,
    settings: Settings,
    log_level: str = "info",
    pid_file: str | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Serve ``target`` with ``settings`` until interrupted (SIGINT/SIGTERM).

    This process and every worker are non-dumpable (`gym_sessions.non_dumpable`):
    they hold the secret. Workers receive ``settings`` in the config they
    are started with (`WorkerConfig`: forked from this process on Linux,
    pickled through uvicorn's spawn pipe elsewhere), never through their
    environment or argv.

    Args:
        target: A registered Gymnasium id or ``module:attr``.
        settings: The server's settings.
        log_level: uvicorn's log level.
        pid_file: Where to write the supervisor's pid, if anywhere.
        env_kwargs: Keyword arguments for the env class, factory or
            ``gymnasium.make`` of every session (they travel to the workers
            inside the target, a `ServeTarget`).

    Raises:
        StartupError: the target is bad or the address cannot be bound.
    """
    import uvicorn

    from gym_sessions.metrics.directory import MetricsDirectory
    from gym_sessions.runtime_dir import RuntimeDirectory
    from gym_sessions.server.targets import ServeTarget
    from gym_sessions.server.worker import WorkerConfig, WorkerSpec
    from gym_sessions.transport.http_protocol import BoundedHttpProtocol
    from gym_sessions.transport.supervisor import Supervisor
    from gym_sessions.transport.worker_start import WORKERS_FORK, check_in_child

    if env_kwargs:
        target = ServeTarget(target, env_kwargs)
    _make_non_dumpable()  # again for callers from Python; main() did it before reading the secret
    supervised = settings.workers > 1 or settings.routed
    # Fail here, with one clear line, rather than in every worker. Workers fork
    # from this process: were the target imported here, every worker, those of
    # a reload too, would serve the code of this moment, so a child checks it.
    if supervised and WORKERS_FORK:
        check_in_child(_check_target, target, settings)
    else:
        _check_target(target, settings)
    if settings.redis_claims:
        from gym_sessions.routing.redis_eviction import check_redis

        check_redis(settings.claims)
    sock = _bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    if supervised:
        # Claims and private sockets (file claims), the workers' shutdown marks
        # (every routed server), and the metrics files (every supervised server).
        RuntimeDirectory.remove_abandoned()  # left by servers whose supervisor was killed
    runtime_dir = RuntimeDirectory.create() if supervised else None
    metrics_dir = None
    if runtime_dir is not None:
        settings = settings.replace(runtime_dir=runtime_dir.path)
        if settings.metrics:
            # Before any worker starts: each inherits it and records into the
            # shared files, so any worker's /metrics adds all of them up.
            metrics_dir = MetricsDirectory.of(runtime_dir.path)
            metrics_dir.create()
            metrics_dir.export()
    config = WorkerConfig(
        WorkerSpec(target, settings),
        http=functools.partial(
            BoundedHttpProtocol,
            max_head_bytes=settings.max_header_bytes,
            head_timeout=settings.header_timeout,
        ),
        workers=settings.workers,
        host=settings.host,
        port=port,
        timeout_keep_alive=int(settings.timeout_keep_alive),
        # A /ws message carries a body and its envelope (§3.16): 1009 beyond.
        ws_max_size=settings.max_body_bytes + WS_ENVELOPE_BYTES,
        timeout_graceful_shutdown=int(settings.graceful_timeout),
        log_level=log_level,
    )
    shown_host = f"[{host}]" if ":" in host else host
    routing = "routed" if settings.routed else "not routed"
    if settings.routed and settings.redis_claims:
        routing += f" (claims in {_without_password(settings.claims)})"
    print(
        f"gym-sessions: serving {target} on http://{shown_host}:{port} "
        f"with {settings.workers} worker(s), sessions {routing} (supervisor pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )
    if pid_file is not None:
        _write_pid_file(pid_file)
    try:
        if supervised:
            Supervisor(config, [sock], settings.drain_timeout, settings.worker_start_timeout).run()
        else:
            # One worker serving in-process: nothing to reload into; say so
            # rather than let SIGHUP's default action kill the server.
            signal.signal(signal.SIGHUP, _reload_needs_workers)
            config.load()  # builds the app here, so its errors surface as they do with workers
            uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if metrics_dir is not None:
            metrics_dir.unexport()
        if runtime_dir is not None:
            runtime_dir.remove()
        if pid_file is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(pid_file)


def _check_target(target: str, settings: Settings) -> None:
    """Load ``target`` and refuse settings it cannot serve with (`StartupError`)."""
    from gym_sessions.server.base import SessionServer
    from gym_sessions.server.targets import load_target

    served = load_target(target)
    _check_egress(served, settings)
    if isinstance(served, SessionServer):
        served.check_settings(settings)
        if settings.durable_sessions:
            _report_durability(served, settings)


def _check_egress(served: Any, settings: Settings) -> None:
    """Refuse --allow-env / --allow-model for a server that calls nothing (a likely mix-up)."""
    from gym_sessions.server.agent import AgentServer

    if (settings.allowed_envs or settings.allowed_models) and not isinstance(served, AgentServer):
        raise StartupError(
            "--allow-env and --allow-model are for agent servers; this target is not one"
        )


def _reload_needs_workers(signum: int, frame: object) -> None:
    logging.getLogger("gym_sessions.supervisor").warning(
        "SIGHUP ignored: a reload needs --workers 2 or more (or Redis claims)"
    )


def _write_pid_file(path: str) -> None:
    with open(path, "w") as file:
        file.write(f"{os.getpid()}\n")


def reload_server(pid_file: str | None, pid: int | None) -> None:
    """Send SIGHUP to a running ``gym-sessions serve`` supervisor (zero-downtime reload).

    Raises:
        StartupError: no pid given, or no such process.
    """
    if pid is None:
        if pid_file is None:
            raise StartupError("reload needs --pid-file PATH or --pid PID")
        try:
            with open(pid_file) as file:
                pid = int(file.read().strip())
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read a pid from {pid_file}: {exc}") from exc
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise StartupError(f"no process {pid}: is the server running?") from None


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    _, at, location = rest.rpartition("@")
    return f"{scheme}{sep}***@{location}" if at else url


def _parse_env_kwargs(text: str) -> dict[str, Any]:
    """The ``--env-kwargs`` value: a JSON object of constructor keyword arguments.

    Raises:
        StartupError: ``text`` is not JSON, or not a JSON object.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise StartupError(f"--env-kwargs is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise StartupError(
            f"--env-kwargs must be a JSON object like '{{\"size\": 8}}', got {text!r}"
        )
    return value


def _version() -> str:
    try:
        return importlib.metadata.version("gym-sessions")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gym-sessions", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"gym-sessions {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_cmd = commands.add_parser(
        "serve",
        help="serve an environment over HTTP",
        epilog=SERVE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_cmd.add_argument(
        "target",
        metavar="TARGET",
        help="a registered Gymnasium id or module:attr (see below)",
    )
    serve_cmd.add_argument(
        "--env-kwargs",
        metavar="JSON",
        help="a JSON object of keyword arguments for the env class, factory or gymnasium.make "
        "of every session, e.g. '{\"size\": 8}'",
    )
    serve_cmd.add_argument("--workers", type=int, default=1, help="worker processes (default 1)")
    serve_cmd.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve_cmd.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    serve_cmd.add_argument(
        "--secret-file",
        metavar="PATH",
        help="file holding the secret that signs cookies and tokens: mode 0600, one line of at "
        f"least 32 characters (default: ${SECRET_ENV}, else random per start)",
    )
    # Kept only to refuse it with a pointer to the two ways that keep the secret secret.
    serve_cmd.add_argument("--secret", dest="command_line_secret", help=argparse.SUPPRESS)
    serve_cmd.add_argument(
        "--window",
        type=float,
        default=300.0,
        help="session_close_retry_window_seconds (default 300)",
    )
    serve_cmd.add_argument(
        "--no-routing",
        action="store_true",
        help="do not route sessions to their worker (stateless servers only)",
    )
    serve_cmd.add_argument(
        "--claims",
        default="file",
        metavar="STORE",
        help="claim store: 'file' (one host, default) or redis://HOST:PORT/DB for several "
        f"hosts behind a load balancer (needs --secret-file or ${SECRET_ENV}, the same on "
        "every host)",
    )
    serve_cmd.add_argument(
        "--private-host",
        default="127.0.0.1",
        help="with Redis claims: the address other hosts reach this host's workers on "
        "(each worker listens on a port of its own there; default 127.0.0.1)",
    )
    limits = serve_cmd.add_argument_group("limits (docs/operating/limits.md)")
    limits.add_argument(
        "--max-sessions",
        type=int,
        default=0,
        metavar="N",
        help="open sessions per worker; a start on a full worker goes to one with room, 503 "
        "capacity_reached when all are full (default 0: no limit)",
    )
    limits.add_argument(
        "--placement",
        choices=("balanced", "local"),
        default="balanced",
        help="where a new session starts: balanced (default), the worker with the fewest open "
        "sessions; local, the worker that accepted the start",
    )
    limits.add_argument(
        "--session-idle-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="close an open session with no request for this long; its next request gets 410 "
        "session_expired (default 3600; 0: never)",
    )
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        metavar="BYTES",
        help="larger request bodies get 413 (default 16 MiB)",
    )
    limits.add_argument(
        "--max-inflight-body-bytes",
        type=int,
        default=256 * 1024 * 1024,
        metavar="BYTES",
        help="memory request bodies may take on one worker at once, their bytes and (bounded "
        "from above) what parsing them takes; beyond, a body waits up to 2 s, then 503 "
        "overloaded, and one that could never fit gets 413 (default 256 MiB)",
    )
    limits.add_argument(
        "--header-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a request head not complete this long after it began gets 408 and is closed "
        "(default 30)",
    )
    lifecycle = serve_cmd.add_argument_group("lifecycle (docs/operating/signals.md)")
    lifecycle.add_argument(
        "--durable-sessions",
        action="store_true",
        help="snapshot each live session after every request that changed it, so a session "
        "whose worker died is restored on another worker instead of 410 (file claims; see "
        "docs/operating/durable-sessions.md)",
    )
    lifecycle.add_argument(
        "--max-snapshot-bytes",
        type=int,
        default=8 * 1024 * 1024,
        metavar="BYTES",
        help="with --durable-sessions: a session whose snapshot is larger is served but not "
        "durable (default 8 MiB)",
    )
    lifecycle.add_argument(
        "--graceful-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long requests already received may run to their reply "
        "(default 30)",
    )
    lifecycle.add_argument(
        "--drain-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="after SIGHUP/SIGTTOU, how long a draining worker serves its open sessions "
        "(default 600)",
    )
    lifecycle.add_argument(
        "--worker-start-timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="on SIGHUP, how long the new workers may take to start serving before the "
        "reload is given up and the current ones keep serving (default 120)",
    )
    lifecycle.add_argument(
        "--pid-file", metavar="PATH", help="write the supervisor's pid here (for reload)"
    )
    serve_cmd.add_argument(
        "--peer-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="with Redis claims: a network workers' private addresses are in (repeatable); "
        "requests are forwarded only there whatever Redis says (default: loopback, when "
        "--private-host is loopback; required otherwise)",
    )
    serve_cmd.add_argument(
        "--handoff",
        choices=["on", "off"],
        default="on" if Settings.handoff else "off",
        help="with file claims (one host): a request reaching a worker that does not hold its "
        "session hands its client connection to the holder, which serves that connection from "
        "then on; off: every such request is forwarded over the holder's private socket "
        f"(default {'on' if Settings.handoff else 'off'})",
    )
    serve_cmd.add_argument(
        "--claims-timeout",
        type=float,
        default=Settings.claims_timeout,
        metavar="SECONDS",
        help="with Redis claims: how long one Redis call may take in all (waiting for a pooled "
        "connection included) before its request gets 503 claims_unavailable "
        f"(default {Settings.claims_timeout:g})",
    )
    serve_cmd.add_argument(
        "--private-max-connections",
        type=int,
        default=Settings.private_max_connections,
        metavar="N",
        help="with Redis claims: open connections each worker's private port accepts, at most a "
        "quarter of the descriptor limit; a new one replaces an idle one "
        f"(default {Settings.private_max_connections})",
    )
    serve_cmd.add_argument(
        "--private-idle-timeout",
        type=float,
        default=Settings.private_idle_timeout,
        metavar="SECONDS",
        help="with Redis claims: how long an idle connection to a private port stays open "
        f"(default {Settings.private_idle_timeout:g})",
    )
    serve_cmd.add_argument(
        "--trust-session-ids",
        action="store_true",
        help="let a typed start or close reach a session by its id alone, without its cookie "
        "or session_key (only when every client is trusted; see docs/operating/credentials.md)",
    )
    serve_cmd.add_argument(
        "--unsandboxed",
        action="store_true",
        help="let servers that run client code (envs.python_repl) run it without their "
        "sandbox when not root (see docs/operating/repl-sandbox.md)",
    )
    egress = serve_cmd.add_argument_group("agent servers: what they may call (docs/security.md)")
    egress.add_argument(
        "--allow-env",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="an env server /run may call (repeatable); a body names it by NAME or by this "
        "exact URL (default: none, every /run gets 400 forbidden_target)",
    )
    egress.add_argument(
        "--allow-model",
        action="append",
        default=[],
        metavar="[NAME=]URL",
        help="a model server a /run body may name (repeatable), as --allow-env (default: none)",
    )
    egress.add_argument(
        "--upstream-max-reply-bytes",
        type=int,
        default=Settings.upstream_max_reply_bytes,
        metavar="BYTES",
        help="an env or model server's reply larger than this is not read: 502 bad_upstream "
        f"(default {Settings.upstream_max_reply_bytes // (1024 * 1024)} MiB)",
    )
    egress.add_argument(
        "--upstream-connect-timeout",
        type=float,
        default=Settings.upstream_connect_timeout,
        metavar="SECONDS",
        help="an outbound call (env or model server) that cannot connect within this gets 502 "
        f"(default {Settings.upstream_connect_timeout:g} s)",
    )
    egress.add_argument(
        "--upstream-timeout",
        type=float,
        default=Settings.upstream_timeout,
        metavar="SECONDS",
        help="an outbound call not answered within this in all gets 504 "
        f"(default {Settings.upstream_timeout:g} s, at most 3600)",
    )
    metrics = serve_cmd.add_argument_group("metrics (docs/operating/metrics.md)")
    metrics.add_argument(
        "--metrics",
        choices=["on", "off"],
        default="on",
        help="GET /metrics in the Prometheus text format, the totals of all workers; off: no "
        "page and nothing recorded (default on)",
    )
    metrics.add_argument(
        "--metrics-token-file",
        metavar="PATH",
        help="file holding a token (mode 0600, one line of at least 32 characters): every "
        "client of /metrics must send Authorization: Bearer <token>, from anywhere (default: "
        "no token, loopback clients only; behind a proxy every client looks local)",
    )
    serve_cmd.add_argument(
        "--debug-worker-header",
        action="store_true",
        help="add x-gym-worker: <worker id> to replies (benchmarks, debugging)",
    )
    serve_cmd.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level (default info)",
    )

    reload_cmd = commands.add_parser(
        "reload",
        help="zero-downtime reload of a running server (SIGHUP to its supervisor)",
    )
    reload_target = reload_cmd.add_mutually_exclusive_group(required=True)
    reload_target.add_argument("--pid-file", metavar="PATH", help="the server's --pid-file")
    reload_target.add_argument("--pid", type=int, help="the supervisor's pid")

    status_cmd = commands.add_parser(
        "status",
        help="a running server's workers and totals, from its /metrics",
        description="Print a table of a running server's live workers (id, pid, open "
        "sessions, claims, requests, forwarded, 409s, 410s, estimated step p50), the workers "
        "that exited, and the totals, read from GET URL/metrics.",
    )
    status_cmd.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
    status_cmd.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2) until Ctrl-C",
    )
    status_cmd.add_argument(
        "--token-file",
        metavar="PATH",
        help="file holding the metrics token the server was started with",
    )

    demo_cmd = commands.add_parser("demo", help="serve the counter env and run episodes against it")
    demo_cmd.add_argument("--workers", type=int, default=4, help="server workers (default 4)")
    demo_cmd.add_argument("--episodes", type=int, default=200, help="episodes (default 200)")
    demo_cmd.add_argument(
        "--concurrency", type=int, default=32, help="episodes at a time (default 32)"
    )
    return parser


def _report_durability(served: Any, settings: Settings) -> None:
    """One line at start-up when durable sessions were asked for but cannot be had."""
    log = logging.getLogger("gym_sessions.supervisor")
    if not settings.routed:
        log.warning(
            "--durable-sessions: one worker has no other worker to restore its sessions on; "
            "sessions are not durable"
        )
        return
    how = served.durability()
    if how is None:
        log.warning(
            "--durable-sessions: %s's sessions cannot be captured (no get_state()/set_state() "
            "and pickle fails): they are not durable, and get 410 when their worker dies",
            type(served).__name__,
        )
    else:
        log.info("durable sessions: %s", how)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "serve":
            if args.command_line_secret is not None:
                raise StartupError(COMMAND_LINE_SECRET_REFUSAL)
            env_kwargs = None if args.env_kwargs is None else _parse_env_kwargs(args.env_kwargs)
            if args.metrics == "off" and args.metrics_token_file is not None:
                raise StartupError("--metrics-token-file has no use with --metrics off")
            _make_non_dumpable()  # before the secret is read into this process
            metrics_token = ""
            if args.metrics_token_file is not None:
                metrics_token = read_secret_file(args.metrics_token_file, "metrics token")
            settings = Settings(
                secret=server_secret(args.secret_file) or "",  # "": random per start
                host=args.host,
                port=args.port,
                workers=args.workers,
                session_close_retry_window_seconds=args.window,
                routes_sessions_to_holder=not args.no_routing,
                debug_worker_header=args.debug_worker_header,
                claims=args.claims,
                private_host=args.private_host,
                peer_networks=tuple(args.peer_network),
                claims_timeout=args.claims_timeout,
                private_max_connections=args.private_max_connections,
                private_idle_timeout=args.private_idle_timeout,
                trust_session_ids=args.trust_session_ids,
                unsandboxed=args.unsandboxed,
                max_sessions=args.max_sessions,
                placement=args.placement,
                session_idle_timeout=args.session_idle_timeout,
                max_body_bytes=args.max_body_bytes,
                max_inflight_body_bytes=args.max_inflight_body_bytes,
                header_timeout=args.header_timeout,
                graceful_timeout=args.graceful_timeout,
                drain_timeout=args.drain_timeout,
                worker_start_timeout=args.worker_start_timeout,
                metrics=args.metrics == "on",
                metrics_token=metrics_token,
                durable_sessions=args.durable_sessions,
                max_snapshot_bytes=args.max_snapshot_bytes,
                handoff=args.handoff == "on",
                allowed_envs=tuple(args.allow_env),
                allowed_models=tuple(args.allow_model),
                upstream_max_reply_bytes=args.upstream_max_reply_bytes,
                upstream_connect_timeout=args.upstream_connect_timeout,
                upstream_timeout=args.upstream_timeout,
            )
            serve(args.target, settings, args.log_level, args.pid_file, env_kwargs)
        elif args.command == "reload":
            reload_server(args.pid_file, args.pid)
        elif args.command == "status":
            return _status(args.url, args.token_file, args.watch)
        else:
            from gym_sessions.demo import run_demo

            return run_demo(args.workers, args.episodes, args.concurrency)
    except (StartupError, ValueError) as exc:
        print(f"gym-sessions: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP_FAILURE
    except StatusError as exc:
        print(f"gym-sessions: error: {exc}", file=sys.stderr)
        return EXIT_STATUS_FAILURE
    return 0


def _status(url: str, token_file: str | None, watch: float | None) -> int:
    from gym_sessions.metrics.status import run_status

    if watch is not None and watch <= 0:
        raise StartupError("--watch needs a positive number of seconds")
    token = read_secret_file(token_file, "metrics token") if token_file is not None else None
    return run_status(url, token, watch)


if __name__ == "__main__":
    sys.exit(main())
