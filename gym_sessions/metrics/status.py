"""``gym-sessions status URL``: a server's workers and totals as a table, read from ``/metrics``.

One row per live worker (``gym_sessions_worker_info``), one for the workers
that have exited (their counts stay in the totals), and the totals. The step
p50 is estimated from the ``tool_call_seconds`` histogram of the ``step`` tool
as Prometheus's ``histogram_quantile`` does: linearly inside the bucket that
holds the median, so it is only as fine as the buckets.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from gym_sessions.errors import StatusError

__all__ = [
    "Sample",
    "StatusTable",
    "WorkerRow",
    "estimate_quantile",
    "fetch_metrics",
    "parse_samples",
    "run_status",
    "status_table",
]

_STEP_TOOL = "step"
_CLEAR_SCREEN = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class Sample:
    """One sample of a text exposition page."""

    name: str
    labels: Mapping[str, str]
    value: float


def parse_samples(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition page.

    Raises:
        StatusError: the text is not in the exposition format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        return [
            Sample(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]
    except ValueError as exc:
        raise StatusError(f"not a Prometheus text page: {exc}") from None


def estimate_quantile(buckets: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of a histogram from its cumulative ``(le, count)`` buckets.

    Linear inside the bucket holding the rank (its lower edge is the previous
    bound, or 0); a rank in the ``+Inf`` bucket gives the highest finite bound.
    ``None`` when the histogram holds no observation.
    """
    ordered = sorted(buckets)
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in ordered:
        if count >= rank:
            if math.isinf(bound):
                return lower
            if count == below:
                return bound
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


@dataclass
class WorkerRow:
    """One row of the table: a live worker, the exited workers together, or the totals."""

    worker: str
    pid: str = ""
    open_sessions: float | None = None
    claims: float | None = None
    requests: float = 0.0
    forwarded: float = 0.0
    conflicts: float = 0.0
    gone: float = 0.0
    step_buckets: dict[float, float] = field(default_factory=dict)

    @property
    def step_p50(self) -> float | None:
        """Median step time in seconds (estimated), or ``None`` without steps."""
        return estimate_quantile(self.step_buckets.items(), 0.5)

    def add(self, other: WorkerRow) -> None:
        """Add ``other``'s counts and steps to this row (gauges only where both have them)."""
        self.requests += other.requests
        self.forwarded += other.forwarded
        self.conflicts += other.conflicts
        self.gone += other.gone
        for bound, count in other.step_buckets.items():
            self.step_buckets[bound] = self.step_buckets.get(bound, 0.0) + count
        if other.open_sessions is not None:
            self.open_sessions = (self.open_sessions or 0.0) + other.open_sessions
        if other.claims is not None:
            self.claims = (self.claims or 0.0) + other.claims


@dataclass
class StatusTable:
    """The live workers' rows, the exited workers' row (if any) and the totals."""

    live: list[WorkerRow]
    exited: WorkerRow | None
    exited_count: int
    totals: WorkerRow

    def render(self) -> str:
        """The table as text, one line per row, columns aligned."""
        header = ["worker", "pid", "open", "claims", "requests", "forwarded", "409", "410"]
        lines = [[*header, "step p50"]]
        rows = list(self.live)
        if self.exited is not None:
            rows.append(self.exited)
        for row in [*rows, self.totals]:
            lines.append(
                [
                    row.worker,
                    row.pid,
                    _count(row.open_sessions),
                    _count(row.claims),
                    _count(row.requests),
                    _count(row.forwarded),
                    _count(row.conflicts),
                    _count(row.gone),
                    _milliseconds(row.step_p50),
                ]
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) + 1)]
        rendered = []
        for line in lines:
            cells = [line[0].ljust(widths[0])]
            cells += [cell.rjust(width) for cell, width in zip(line[1:], widths[1:], strict=True)]
            rendered.append("  ".join(cells).rstrip())
        return "\n".join(rendered) + "\n"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


def status_table(samples: Iterable[Sample]) -> StatusTable:
    """Build the table from a ``/metrics`` page's samples.

    Raises:
        StatusError: the page has no gym-sessions worker in it.
    """
    rows: dict[str, WorkerRow] = {}
    live: dict[str, str] = {}

    def row(worker: str) -> WorkerRow:
        return rows.setdefault(worker, WorkerRow(worker))

    for sample in samples:
        worker = sample.labels.get("worker")
        if worker is None:
            continue
        name, value = sample.name, sample.value
        if name == "gym_sessions_worker_info" and value > 0:
            live[worker] = sample.labels.get("pid", "")
            row(worker)
        elif name == "gym_sessions_worker_requests_total":
            row(worker).requests += value
            if sample.labels.get("served") == "forwarded":
                row(worker).forwarded += value
        elif name == "gym_sessions_session_refusals_total":
            status = sample.labels.get("status")
            if status == "409":
                row(worker).conflicts += value
            elif status == "410":
                row(worker).gone += value
        elif name == "gym_sessions_open_sessions":
            row(worker).open_sessions = value
        elif name == "gym_sessions_claims":
            row(worker).claims = value
        elif (
            name == "gym_sessions_tool_call_seconds_bucket"
            and sample.labels.get("tool") == _STEP_TOOL
        ):
            bound = float(sample.labels["le"])
            buckets = row(worker).step_buckets
            buckets[bound] = buckets.get(bound, 0.0) + value  # summed over http and mcp
    if not rows:
        raise StatusError("the page holds no gym-sessions worker metrics")
    live_rows = []
    for worker, pid in sorted(live.items(), key=lambda item: (int(item[1] or 0), item[0])):
        rows[worker].pid = pid
        live_rows.append(rows[worker])
    exited_workers = [r for worker, r in rows.items() if worker not in live]
    exited = None
    if exited_workers:
        exited = WorkerRow(f"(exited: {len(exited_workers)})")
        for r in exited_workers:
            r.open_sessions = r.claims = None  # a gone worker holds nothing
            exited.add(r)
    totals = WorkerRow("total")
    for r in live_rows:
        totals.add(r)
    if exited is not None:
        totals.add(exited)
    if totals.open_sessions is None:
        totals.open_sessions = totals.claims = 0.0
    return StatusTable(live_rows, exited, len(exited_workers), totals)


def metrics_url(url: str) -> str:
    """The ``/metrics`` URL of a server given by its base URL (or that URL itself)."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch_metrics(url: str, token: str | None = None, timeout: float = 10.0) -> str:
    """The text of ``GET <url>/metrics`` (with ``Authorization: Bearer <token>`` if given).

    Raises:
        StatusError: unreachable, or answered with an error (its message included).
    """
    target = metrics_url(url)
    request = urllib.request.Request(target)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        raise StatusError(f"GET {target}: {exc.code} {_error_text(exc)}") from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach {target}: {reason}") from None


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        error = json.loads(exc.read())["error"]
        return f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError, OSError):
        return str(exc.reason)


def _frame(url: str, token: str | None) -> str:
    return status_table(parse_samples(fetch_metrics(url, token))).render()


def run_status(
    url: str, token: str | None = None, watch: float | None = None, out: TextIO | None = None
) -> int:
    """Print the table once, or every ``watch`` seconds until Ctrl-C; returns the exit code.

    Raises:
        StatusError: without ``watch``, the page could not be read. (With it,
            the error is shown in place of the table and the next refresh tries again.)
    """
    out = out or sys.stdout
    if watch is None:
        out.write(_frame(url, token))
        return 0
    clear = out.isatty()
    try:
        while True:
            try:
                body = _frame(url, token)
            except StatusError as exc:
                body = f"gym-sessions: error: {exc}\n"
            stamp = time.strftime("%H:%M:%S")
            heading = f"{metrics_url(url)} at {stamp}, every {watch:g} s (Ctrl-C to stop)\n"
            out.write((_CLEAR_SCREEN if clear else "") + heading + body)
            out.flush()
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0
