"""`WorkerMetrics`: what one worker counts for ``GET /metrics``, and the page it renders.

The families (docs/operating/metrics.md lists them for operators), all labelled
``worker`` but the first:

- ``gym_sessions_requests_total{route, status}``: requests accepted on the
  public listener (the server's totals);
- ``gym_sessions_worker_requests_total{served}``: the same by accepting
  worker and `Served` (``local``, ``forwarded``, ``handed_over``);
- ``gym_sessions_session_refusals_total{status}``: 409 and 410 replies;
- ``gym_sessions_expired_sessions_total``: sessions closed for idling;
- ``gym_sessions_tool_call_seconds{tool, via}``: histogram of tool handler
  time (``/step``, MCP ``tools/call``) on the holding worker;
- ``gym_sessions_snapshots_written_total``, ``gym_sessions_restored_sessions_total``:
  durable sessions' snapshots written and sessions restored from one
  (``--durable-sessions``);
- ``gym_sessions_open_sessions``, ``gym_sessions_claims``: gauges, live
  workers only;
- ``gym_sessions_worker_info{pid}``: 1 per live worker.

Every label value is bounded: ``route`` is a route template of the server
(or ``unmatched``), never a raw path; ``status`` is an HTTP status (or
``none`` when the client left before any reply); ``worker`` ids are as many as
the workers the server started. A request is counted where it was accepted,
never again on the worker it was forwarded to, and it is counted as its last
reply byte is handed on, so a client that has its reply can already see it.

The hot path is a few dictionary lookups and counter increments (memory
stores into shared files with several workers, see `MetricsDirectory`).

Recording never fails the request it counts (issue 33: a step that ran
answered 500 because a metrics file could not be opened, descriptors being
exhausted): a failed record is dropped, counted in `WorkerMetrics.lost_records`
and logged at most once a minute.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Concatenate, ParamSpec

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import values as prometheus_values
from prometheus_client.multiprocess import MultiProcessCollector

from gym_sessions.metrics.directory import MetricsDirectory
from gym_sessions.scope_keys import Served
from gym_sessions.wire import route_path

__all__ = [
    "CONTENT_TYPE",
    "NO_REPLY_STATUS",
    "ROLLOUT_TEMPLATE",
    "TOOL_SECONDS_BUCKETS",
    "UNMATCHED_ROUTE",
    "RouteLabels",
    "WorkerMetrics",
]

logger = logging.getLogger("gym_sessions.metrics")

#: The Prometheus text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UNMATCHED_ROUTE = "unmatched"
NO_REPLY_STATUS = "none"
ROLLOUT_TEMPLATE = "/rollouts/{rollout_id}"
#: From a counter step served in ~0.1 ms to a simulator step of tens of seconds.
TOOL_SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
# Statuses counted per worker besides the totals: a session's conflicts and losses.
_REFUSAL_STATUSES = (409, 410)


_P = ParamSpec("_P")
# A worker that cannot record says so this often in its log (not once per request).
_LOST_LOG_SECONDS = 60.0


def _best_effort(
    record: Callable[Concatenate[WorkerMetrics, _P], None],
) -> Callable[Concatenate[WorkerMetrics, _P], None]:
    """A recording method that never raises: telemetry must not fail what it counts."""

    @functools.wraps(record)
    def guarded(self: WorkerMetrics, *args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            record(self, *args, **kwargs)
        except Exception as exc:
            self._record_lost(record.__name__, exc)

    return guarded


class RouteLabels:
    """The ``route`` label of a request path: a route template of the server, or ``unmatched``.

    Args:
        templates: The server's route paths (bare: every one is also served
            under ``/rollouts/{rollout_id}``).
    """

    def __init__(self, templates: Iterable[str]) -> None:
        self.templates = frozenset(templates)

    def __call__(self, path: str) -> str:
        if path in self.templates:
            return path
        bare = route_path(path)
        if bare != path and bare in self.templates:
            return ROLLOUT_TEMPLATE + bare
        return UNMATCHED_ROUTE


def _status_label(status: int | None) -> str:
    if status is None:
        return NO_REPLY_STATUS
    return str(status) if 100 <= status <= 599 else "other"


class _WithoutCreated:
    """A registry's families without the ``_created`` samples of single-process mode.

    Multiprocess files do not keep creation times; leaving them out in both
    modes gives one page whatever the number of workers.
    """

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterator[Any]:
        for family in self.source.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class WorkerMetrics:
    """The metrics one worker records, and the page any worker renders for all of them.

    Args:
        worker_id: This worker's id (the ``worker`` label).
        routes: The server's route templates (`RouteLabels`).
        directory: The server's metrics directory; when this process records
            into it (`MetricsDirectory.active`), the page adds up every
            worker's files. Otherwise (one worker in-process, or several apps
            in one test process) the page holds this app's own numbers.
    """

    def __init__(
        self, worker_id: str, routes: Iterable[str], directory: MetricsDirectory | None = None
    ) -> None:
        self.worker_id = worker_id
        self.route_label = RouteLabels(routes)
        self.directory = directory if directory is not None and directory.active else None
        if self.directory is not None and not getattr(
            prometheus_values.ValueClass, "_multiprocess", False
        ):
            # prometheus_client was imported before the variable was set: this
            # worker's numbers would be missing from every other worker's page.
            logger.error(
                "metrics: prometheus_client is not in multiprocess mode in worker %s; "
                "/metrics shows this worker's numbers only",
                worker_id,
            )
            self.directory = None
        registry = CollectorRegistry(auto_describe=True) if self.directory is None else None
        self._requests = Counter(
            "gym_sessions_requests",
            "Requests accepted on the public listener, by route template and reply status.",
            ["route", "status"],
            registry=registry,
        )
        worker_requests = Counter(
            "gym_sessions_worker_requests",
            "Requests accepted by each worker: served here (local), by the session's holder "
            "(forwarded), or after a session handover (handed_over, reserved).",
            ["worker", "served"],
            registry=registry,
        )
        refusals = Counter(
            "gym_sessions_session_refusals",
            "409 (session conflict or closed) and 410 (session gone or expired) replies, by "
            "accepting worker.",
            ["worker", "status"],
            registry=registry,
        )
        expired = Counter(
            "gym_sessions_expired_sessions",
            "Sessions the server closed because they idled out (--session-idle-timeout).",
            ["worker"],
            registry=registry,
        )
        snapshots_written = Counter(
            "gym_sessions_snapshots_written",
            "Snapshots of durable sessions written (--durable-sessions), by writing worker.",
            ["worker"],
            registry=registry,
        )
        restored = Counter(
            "gym_sessions_restored_sessions",
            "Durable sessions a worker restored from their snapshot after their holder died.",
            ["worker"],
            registry=registry,
        )
        self._tool_seconds = Histogram(
            "gym_sessions_tool_call_seconds",
            "Time of tool calls (env step and observe) in their handler, on the holding "
            "worker, by tool and by way of call (http or mcp).",
            ["worker", "tool", "via"],
            buckets=TOOL_SECONDS_BUCKETS,
            registry=registry,
        )
        # livesum: with several workers the files of exited ones are dropped;
        # each series has its own worker label, so the sum is that worker's value.
        open_sessions = Gauge(
            "gym_sessions_open_sessions",
            "Live sessions each live worker holds.",
            ["worker"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        claims = Gauge(
            "gym_sessions_claims",
            "Claims each live worker holds in memory (open sessions, starts in progress, "
            "closed sessions kept for the window).",
            ["worker"],
            multiprocess_mode="livesum",
            registry=registry,
        )
        # The pid label: multiprocess mode adds it to "liveall" gauges by itself
        # (and would drop a label of that name from "livesum" ones).
        info = Gauge(
            "gym_sessions_worker_info",
            "1 for every live worker, with its process id.",
            ["worker"] if self.directory is not None else ["worker", "pid"],
            multiprocess_mode="liveall",
            registry=registry,
        )
        self._registry = registry
        # Children made once: the hot path does no label handling.
        self._served = {s: worker_requests.labels(worker_id, s.value) for s in Served}
        self._refusals = {s: refusals.labels(worker_id, str(s)) for s in _REFUSAL_STATUSES}
        self._expired = expired.labels(worker_id)
        self._snapshots_written = snapshots_written.labels(worker_id)
        self._restored = restored.labels(worker_id)
        self._open_sessions = open_sessions.labels(worker_id)
        self._claims = claims.labels(worker_id)
        self._request_children: dict[tuple[str, str], Any] = {}
        self._tool_children: dict[tuple[str, str], Any] = {}
        self._counts = (-1, -1)
        #: Records dropped because recording failed (a metrics file could not be opened).
        self.lost_records = 0
        self._lost_logged_at = float("-inf")
        pid = () if self.directory is not None else (str(os.getpid()),)
        info.labels(worker_id, *pid).set(1)
        self.counts(0, 0)

    # Recording (hot path) -----------------------------------------------------------------

    @_best_effort
    def request_done(self, path: str, status: int | None, served: Served) -> None:
        """Count a request accepted on the public listener, as its reply ends.

        Args:
            path: The request's path (its label is the route template).
            status: The reply's status; ``None`` if no reply was started.
            served: Where the reply came from.
        """
        key = (self.route_label(path), _status_label(status))
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self._requests.labels(*key)
        child.inc()
        self._served[served].inc()
        refusal = self._refusals.get(status) if status is not None else None
        if refusal is not None:
            refusal.inc()

    @_best_effort
    def tool_call(self, tool: str, via: str, seconds: float) -> None:
        """Record one tool call's handler time (``via``: ``http`` or ``mcp``)."""
        key = (tool, via)
        child = self._tool_children.get(key)
        if child is None:
            child = self._tool_children[key] = self._tool_seconds.labels(self.worker_id, *key)
        child.observe(seconds)

    @_best_effort
    def session_expired(self) -> None:
        """Count a session closed for idling."""
        self._expired.inc()

    @_best_effort
    def snapshot_written(self) -> None:
        """Count a durable session's snapshot written here."""
        self._snapshots_written.inc()

    @_best_effort
    def session_restored(self) -> None:
        """Count a durable session restored here from its snapshot."""
        self._restored.inc()

    @_best_effort
    def counts(self, claims: int, open_sessions: int) -> None:
        """This worker now holds ``claims`` claims, ``open_sessions`` of them live."""
        if (claims, open_sessions) == self._counts:
            return  # most claim changes leave one of the two alone: no write
        if claims != self._counts[0]:
            self._claims.set(claims)
        if open_sessions != self._counts[1]:
            self._open_sessions.set(open_sessions)
        self._counts = (claims, open_sessions)

    def _record_lost(self, what: str, exc: Exception) -> None:
        self.lost_records += 1
        now = time.monotonic()
        if now - self._lost_logged_at >= _LOST_LOG_SECONDS:
            self._lost_logged_at = now
            logger.warning(
                "metrics: %s could not be recorded (%s: %s); %d record(s) lost so far, "
                "requests are served on",
                what,
                type(exc).__name__,
                exc,
                self.lost_records,
            )

    # The page -------------------------------------------------------------------------------

    @property
    def multiprocess(self) -> bool:
        """Whether the page adds up every worker's files (else it is this app's alone)."""
        return self.directory is not None

    def render(self) -> bytes:
        """The text exposition page: the server's totals (blocking file reads; run off-loop)."""
        registry = CollectorRegistry(auto_describe=False)
        if self.directory is not None:
            self.directory.forget_exited_workers()
            MultiProcessCollector(registry, path=self.directory.path)
        else:
            assert self._registry is not None
            registry.register(_WithoutCreated(self._registry))
        return generate_latest(registry)
