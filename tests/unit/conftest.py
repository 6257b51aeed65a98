"""Unit-test fixtures: in-process clusters, stopped at teardown."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from .cluster import Cluster, start_cluster


@pytest.fixture
async def start_clusters(short_tmp) -> AsyncIterator[Callable[..., Any]]:
    """``await start_clusters(server_class, n, clock=None, **settings)``; all stop at teardown.

    ``clock``: a `FakeClock` for the workers' claim windows (see `Cluster.elapse`).
    """
    made: list[Cluster] = []

    async def make(server_class: Any, n: int, **settings: Any) -> Cluster:
        cluster = await start_cluster(server_class, n, short_tmp, **settings)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        await cluster.stop()
