"""Operator metrics: ``GET /metrics`` in the Prometheus text format, and ``gym-sessions status``.

- `recorder`: `WorkerMetrics`, the families and what each worker records;
- `directory`: `MetricsDirectory`, the shared files that add workers up;
- `endpoint`: `MetricsMiddleware`, counting requests and serving the page;
- `access`: `MetricsAccess`, who may read it;
- `status`: the ``gym-sessions status`` table.
"""

from gym_sessions.metrics.access import MetricsAccess
from gym_sessions.metrics.directory import MetricsDirectory
from gym_sessions.metrics.endpoint import METRICS_PATH, MetricsMiddleware
from gym_sessions.metrics.recorder import CONTENT_TYPE, WorkerMetrics

__all__ = [
    "CONTENT_TYPE",
    "METRICS_PATH",
    "MetricsAccess",
    "MetricsDirectory",
    "MetricsMiddleware",
    "WorkerMetrics",
]
