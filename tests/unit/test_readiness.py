"""``GET /ready``: readiness apart from ``/health`` (liveness), for load balancers."""

from __future__ import annotations

from gym_sessions.runtime_dir import SERVER_MARK
from tests.unit.probe_server import ProbeServer


async def test_ready_until_a_drain_starts_while_health_stays_ok(cluster):
    c = await cluster(2)
    ready = await c[0].request("GET", "/ready")
    assert ready.status == 200 and ready.json["status"] == "ready"
    c[0].app.begin_drain()
    unready = await c[0].request("GET", "/ready")
    assert unready.status == 503 and unready.json["error"]["code"] == "not_ready"
    assert "draining" in unready.json["error"]["message"]
    # Liveness is unchanged: the draining worker still serves its open sessions.
    health = await c[0].request("GET", "/health")
    assert health.status == 200 and health.json["draining"] is True
    assert (await c[1].request("GET", "/ready")).status == 200


async def test_unready_as_soon_as_the_whole_server_stops(start_clusters):
    c = await start_clusters(ProbeServer, 2)
    coordination = c[0].app.coordination
    assert coordination is not None
    coordination.mark(SERVER_MARK, "stopping")  # what the supervisor writes on SIGTERM
    for index in range(2):
        reply = await c[index].request("GET", "/ready")
        assert reply.status == 503 and "stopping" in reply.json["error"]["message"]
