"""The one settings object every gym-sessions server is built from."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from gym_sessions.upstreams import UpstreamTargets
from gym_sessions.wire import SESSION_COOKIE

__all__ = ["SECRET_ENV", "Settings"]

SECRET_ENV = "GYM_SESSIONS_SECRET"
_MIB = 1024 * 1024
# An outbound call of an agent may take at most this long (a bound on --upstream-timeout).
_MAX_UPSTREAM_SECONDS = 3600.0


_CLAIM_STORES = ("file", "redis://", "rediss://", "unix://")


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _redis_is_local(url: str) -> bool:
    """Whether a Redis URL points at this machine (so its workers all are here too)."""
    if url.startswith("unix://"):
        return True
    host = urllib.parse.urlsplit(url).hostname
    return host is None or _is_loopback(host)


@dataclass(frozen=True)
class Settings:
    """Settings of one server (docs/design.md §3.1).

    Attributes:
        host: Public listener address.
        port: Public listener port.
        workers: uvicorn worker processes sharing the public socket.
        secret: Signs session cookies and MCP tokens (and, with Redis claims,
            requests forwarded between hosts). Unset: ``$GYM_SESSIONS_SECRET``,
            else random per server start (the supervisor hands that one value
            to every worker, never through their environment or command
            line). With Redis claims every host must share one secret, so an
            unset secret is refused. ``gym-sessions serve`` takes it from
            ``--secret-file`` or ``$GYM_SESSIONS_SECRET`` (see
            `gym_sessions.secret_source`).
        session_cookie: Name of the signed session cookie.
        session_close_retry_window_seconds: How long a session that is no longer
            open keeps its claim, and how long a closed id is remembered.
        routes_sessions_to_holder: Route each request to the worker that holds its
            session (only matters with several workers).
        checkpoint_session_starts: Paths (without rollout prefix) that start a session.
        max_body_bytes: Larger request bodies get 413.
        max_inflight_body_bytes: Memory request bodies may take on one worker
            at once, from the first byte to the reply: their bytes, and, once
            read, an upper bound of what parsing them takes (2-25 times their
            size for JSON; docs/operating/limits.md). A body that does not fit
            waits up to 2 s, then gets 503 ``overloaded``; one that could never
            fit gets 413.
        max_header_bytes: A request head (request line and headers) larger than
            this gets 431 as soon as it crosses the limit, and its connection closes.
        graceful_timeout: On SIGTERM/SIGINT, how long requests already received
            (forwarded ones included) may run to their reply before the worker exits.
        drain_timeout: How long a draining worker (after SIGHUP or SIGTTOU) keeps
            serving its open sessions before it closes them and exits.
        worker_start_timeout: On SIGHUP, how long the new workers may take to
            import the target and serve before the reload is given up (the
            current workers then keep serving).
        header_timeout: A request head not complete this many seconds after it
            began (or a new connection silent that long) gets 408 and is closed.
        body_read_timeout_seconds: A request body that stalls longer than this
            between two chunks gets 408 (a slow client cannot hold a worker's
            memory and a claim's in-flight count forever).
        claims: Claim store: ``file`` (one host: files in the runtime
            directory) or a Redis URL ``redis://host:port/db`` (several hosts;
            also ``rediss://`` and ``unix://``).
        private_host: With Redis claims, the address each worker's private TCP
            listener binds and registers (a port per worker, picked by the
            system); other hosts must reach it there.
        claims_timeout: With Redis claims, seconds one call to Redis may take in
            all (waiting for a pooled connection included) before the request
            that needed it gets 503 ``claims_unavailable``.
        private_max_connections: With Redis claims, open connections each
            worker's private TCP listener accepts at most (never more than a
            quarter of the descriptor limit); at the cap a new connection
            replaces an idle one, or gets 503 when all are mid-request.
        private_idle_timeout: With Redis claims, seconds an idle connection to a
            private TCP listener stays open (forwarders close theirs after 15 s).
        peer_networks: With Redis claims, the networks (CIDR) workers' private
            listeners may be in: requests are never forwarded elsewhere, whatever
            Redis says. Default: loopback when ``private_host`` is loopback;
            required otherwise.
        timeout_keep_alive: Seconds an idle client connection stays open. RL
            clients think between steps, so this is longer than uvicorn's 5 s.
        debug_worker_header: Add ``x-gym-worker: <id>`` to replies, naming the
            worker that ran the handler (off by default; for benchmarks and debugging).
        max_sessions: Live sessions each worker may hold (0: no limit). A start
            that lands on a full worker is placed on a worker with room; 503
            ``capacity_reached`` only when every worker is full.
        placement: Where a new session starts: ``"balanced"`` (the default:
            the worker with the fewest open sessions, reached over the hop) or
            ``"local"`` (the worker that accepted the start). Only with routing
            (several workers, or Redis claims).
        session_idle_timeout: Seconds an open session may go without a request
            before the server closes it (0: never); its next request gets 410
            ``session_expired``.
        trust_session_ids: Let a typed start or close that names a session by
            id alone reach it, without the session's cookie or ``session_key``
            (off by default: only for deployments where every client is trusted).
        unsandboxed: Allow servers that run client code (the Python REPL
            example) to run it without their sandbox (off by default).
        metrics: Answer ``GET /metrics`` and record the operator metrics
            (`gym_sessions.metrics`); off: neither, no cost per request.
        metrics_token: When set, ``GET /metrics`` needs ``Authorization:
            Bearer <metrics_token>`` from every client; unset, it is answered
            to loopback clients only. ``gym-sessions serve`` reads it from
            ``--metrics-token-file``; like the secret it travels to workers
            inside their pickled config only.
        durable_sessions: After every request that changed a live session,
            write its snapshot beside its claim before the reply, so the session
            outlives its worker: the next request after the worker died restores
            it elsewhere instead of 410 (envs that can be captured only:
            docs/design.md §3.14).
        max_snapshot_bytes: A session whose snapshot is larger is served but
            not durable (logged once per session).
        handoff: With file claims (one host), a request that reaches a worker
            not holding its session hands its client connection to the holder
            (which then serves that connection) instead of forwarding it;
            where that cannot be done safely the request is forwarded as with
            ``False`` (docs/design.md §3.10.6).
        allowed_envs: Agent servers: the env servers ``/run`` may call, each
            ``URL`` or ``NAME=URL`` (``--allow-env``); a body names one by its
            name or its exact URL, anything else is 400 ``forbidden_target``.
            None given: the agent calls no env server (docs/security.md).
        allowed_models: Agent servers: the model servers a body may name, as
            ``allowed_envs`` (``--allow-model``).
        upstream_max_reply_bytes: Agent servers: an env or model server's reply
            larger than this is not read (502 ``bad_upstream``).
        upstream_connect_timeout: Agent servers: seconds an outbound call (env
            or model server) may take to connect (a free pooled connection's
            wait is not counted: under load it is no failure).
        upstream_timeout: Agent servers: seconds an outbound call may take in
            all, the wait for a pooled connection included (a port that
            accepts and never answers must not hold ``/run`` for minutes).
        runtime_dir: Set by the supervisor for workers > 1; ``None`` otherwise.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    secret: str = field(default="", repr=False)
    session_cookie: str = SESSION_COOKIE
    session_close_retry_window_seconds: float = 300.0
    routes_sessions_to_holder: bool = True
    checkpoint_session_starts: tuple[str, ...] = ("/seed_session", "/reset")
    max_body_bytes: int = 16 * _MIB
    max_inflight_body_bytes: int = 256 * _MIB
    max_header_bytes: int = 64 * 1024
    header_timeout: float = 30.0
    graceful_timeout: float = 30.0
    drain_timeout: float = 600.0
    worker_start_timeout: float = 120.0
    body_read_timeout_seconds: float = 60.0
    claims: str = "file"
    private_host: str = "127.0.0.1"
    peer_networks: tuple[str, ...] = ()
    claims_timeout: float = 10.0
    private_max_connections: int = 256
    private_idle_timeout: float = 60.0
    timeout_keep_alive: float = 120.0
    debug_worker_header: bool = False
    max_sessions: int = 0
    placement: str = "balanced"
    session_idle_timeout: float = 3600.0
    trust_session_ids: bool = False
    unsandboxed: bool = False
    metrics: bool = True
    metrics_token: str = field(default="", repr=False)
    durable_sessions: bool = False
    max_snapshot_bytes: int = 8 * _MIB
    handoff: bool = True
    allowed_envs: tuple[str, ...] = ()
    allowed_models: tuple[str, ...] = ()
    upstream_max_reply_bytes: int = 16 * _MIB
    upstream_connect_timeout: float = 5.0
    upstream_timeout: float = 120.0
    runtime_dir: str | None = None

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("workers must be at least 1")
        if not self.secret:
            object.__setattr__(self, "secret", self._default_secret())
        if self.session_close_retry_window_seconds <= 0:
            raise ValueError("session_close_retry_window_seconds must be positive")
        if self.graceful_timeout < 0 or self.drain_timeout < 0:
            raise ValueError("graceful_timeout and drain_timeout must not be negative")
        if self.worker_start_timeout <= 0:
            raise ValueError("worker_start_timeout must be positive")
        if self.header_timeout <= 0:
            raise ValueError("header_timeout must be positive")
        if self.claims_timeout <= 0 or self.private_idle_timeout <= 0:
            raise ValueError("claims_timeout and private_idle_timeout must be positive")
        if self.private_max_connections < 1:
            raise ValueError("private_max_connections must be at least 1")
        if self.max_sessions < 0:
            raise ValueError("max_sessions must be 0 (no limit) or positive")
        if self.placement not in ("balanced", "local"):
            raise ValueError(f"placement must be 'balanced' or 'local', not {self.placement!r}")
        if self.session_idle_timeout < 0:
            raise ValueError("session_idle_timeout must be 0 (never) or positive")
        if self.max_snapshot_bytes < 1:
            raise ValueError("max_snapshot_bytes must be positive")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be positive")
        if self.upstream_max_reply_bytes < 1:
            raise ValueError("upstream_max_reply_bytes must be positive")
        if not 0 < self.upstream_connect_timeout <= self.upstream_timeout:
            raise ValueError(
                "upstream_connect_timeout must be positive and at most upstream_timeout"
            )
        if not self.upstream_timeout <= _MAX_UPSTREAM_SECONDS:
            raise ValueError(f"upstream_timeout must be at most {_MAX_UPSTREAM_SECONDS:g} s")
        object.__setattr__(self, "allowed_envs", tuple(self.allowed_envs))
        object.__setattr__(self, "allowed_models", tuple(self.allowed_models))
        self.env_targets()  # refuse a malformed --allow-env / --allow-model here, at start-up
        self.model_targets()
        if self.max_inflight_body_bytes < self.max_body_bytes:
            raise ValueError(
                "max_inflight_body_bytes must be at least max_body_bytes (one body must fit)"
            )
        if not self.claims.startswith(_CLAIM_STORES):
            raise ValueError(
                f"unknown claim store {self.claims!r}: use 'file' or a redis://host:port/db URL"
            )
        if self.redis_claims:
            if self.private_host in ("0.0.0.0", "::", ""):
                raise ValueError(
                    "private_host must be an address other hosts can reach, not a wildcard"
                )
            if _is_loopback(self.private_host) and not _redis_is_local(self.claims):
                raise ValueError(
                    f"private_host {self.private_host} is loopback but Redis is on another "
                    "host: other hosts could not reach this host's workers; pass "
                    "--private-host with this host's network address"
                )
        object.__setattr__(self, "checkpoint_session_starts", tuple(self.checkpoint_session_starts))
        object.__setattr__(self, "peer_networks", tuple(self.peer_networks))
        for network in self.peer_networks:
            try:
                ipaddress.ip_network(network, strict=False)
            except ValueError as exc:
                raise ValueError(f"peer network {network!r} is not a CIDR network: {exc}") from None
        if self.redis_claims and not self.peer_networks and not _is_loopback(self.private_host):
            raise ValueError(
                "with Redis claims and a non-loopback --private-host, pass --peer-network CIDR "
                "(the network of your hosts' private addresses): requests are forwarded only "
                "there, whatever Redis says"
            )

    def _default_secret(self) -> str:
        secret = os.environ.get(SECRET_ENV)
        if secret:
            return secret
        if self.redis_claims:
            raise ValueError(
                "with Redis claims every host must sign cookies and tokens with one secret: "
                f"pass --secret-file PATH or set {SECRET_ENV} (the same value on every host)"
            )
        # Never a fixed default: random per server start.
        return secrets.token_urlsafe(32)

    @property
    def redis_claims(self) -> bool:
        """Whether claims live in Redis (workers on several hosts)."""
        return self.claims != "file"

    def allowed_peer_networks(self) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """`peer_networks` parsed, or loopback when none are given (a loopback private host)."""
        names = self.peer_networks or ("127.0.0.0/8", "::1/128")
        return [ipaddress.ip_network(name, strict=False) for name in names]

    @property
    def routed(self) -> bool:
        """Whether requests are routed between workers.

        With file claims: several workers and routing on. With Redis claims
        other hosts' workers exist too, so one worker routes as well.
        """
        return self.routes_sessions_to_holder and (self.workers > 1 or self.redis_claims)

    def env_targets(self) -> UpstreamTargets:
        """`allowed_envs` parsed: the env servers an agent server may call."""
        return UpstreamTargets.parse("env", self.allowed_envs)

    def model_targets(self) -> UpstreamTargets:
        """`allowed_models` parsed: the model servers an agent server may call."""
        return UpstreamTargets.parse("model", self.allowed_models)

    def replace(self, **changes: Any) -> Settings:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)
