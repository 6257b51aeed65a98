"""Unit-test fixtures: in-process clusters, stopped at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from .cluster import CLOSE_RETRY_WINDOW, Cluster, start_cluster
from .probe_server import ProbeServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests of the hop's own machinery (its pool, its errors) run with handoff off only,
    tests of handoff (which turn it on themselves) once, and Redis-claim clusters once:
    handoff needs file claims (descriptors cross no host), so with Redis both cases
    would run the same hop."""
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = {} if callspec is None else callspec.params
        handoff = params.get("start_clusters")
        unwanted = (
            (handoff is True and item.get_closest_marker("hop_only") is not None)
            or (handoff is False and item.get_closest_marker("handoff_only") is not None)
            or (handoff is True and _redis_claims(item, params))
        )
        (dropped if unwanted else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def _redis_claims(item: pytest.Item, params: dict[str, Any]) -> bool:
    """Whether the item's clusters keep claims in Redis (the `cluster` fixture's
    "redis" case, or a test that asks for a Redis server and builds its own)."""
    if "cluster" in params:
        return params["cluster"] == "redis"
    return bool(_REDIS_FIXTURES & set(getattr(item, "fixturenames", ())))


#: The fixtures of a test that keeps its clusters' claims in Redis.
_REDIS_FIXTURES = {"redis_server", "private_redis_server"}


@pytest.fixture(params=[True, False], ids=["handoff", "hop"])
async def start_clusters(request, short_tmp) -> AsyncIterator[Callable[..., Any]]:
    """``await start_clusters(server_class, n, clock=None, **settings)``; all stop at teardown.

    ``clock``: a `FakeClock` for the workers' claim windows (see `Cluster.elapse`).
    Every test using it runs twice: connection handoff on, and off (the hop only).
    """
    made: list[Cluster] = []

    async def make(server_class: Any, n: int, **settings: Any) -> Cluster:
        settings.setdefault("handoff", request.param)
        cluster = await start_cluster(server_class, n, short_tmp, **settings)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.stop()


@pytest.fixture(params=["file", "redis"])
def cluster(request, start_clusters) -> Callable[..., Any]:
    """``await cluster(n=3, server=ProbeServer, **settings)``, claims in files or a real Redis.

    Each test using it runs with both claim stores (and, through `start_clusters`,
    with handoff on and off); the close-retry window is `CLOSE_RETRY_WINDOW`
    unless ``settings`` say otherwise.
    """
    store = request.param

    async def make(n: int = 3, server: Any = ProbeServer, **settings: Any) -> Cluster:
        settings.setdefault("session_close_retry_window_seconds", CLOSE_RETRY_WINDOW)
        if store == "redis":
            settings["claims"] = request.getfixturevalue("redis_server").url
        return await start_clusters(server, n, **settings)

    return make
