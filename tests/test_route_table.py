"""`RouteTable` picks the route Starlette's scan picks, for every request."""

from typing import Any

import pytest
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route, Router

from gym_sessions.server.route_table import RouteTable


def _endpoint(name: str) -> Any:
    async def endpoint(request: Any) -> PlainTextResponse:
        return PlainTextResponse(name)

    return endpoint


ROUTES = [
    Route("/health", _endpoint("health"), methods=["GET"]),
    Route("/seed_session", _endpoint("seed-first"), methods=["POST"]),
    Route("/seed_session", _endpoint("seed-second"), methods=["POST", "PUT"]),
    Route("/step", _endpoint("step"), methods=["POST"]),
    Route("/any", _endpoint("any")),
    Route("/{name}", _endpoint("param")),
    Route("/late", _endpoint("late"), methods=["POST"]),  # the param route shadows it
    Mount(
        "/rollouts/{rollout_id}", routes=[Route("/step", _endpoint("mounted"), methods=["POST"])]
    ),
]


async def _call(router: Router, method: str, path: str, root_path: str = "") -> tuple[Any, ...]:
    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "root_path": root_path,
        "query_string": b"",
        "headers": [],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await router(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent[1:])
    route = scope.get("route")
    return sent[0]["status"], body, scope.get("endpoint"), route, scope.get("path_params")


@pytest.mark.parametrize(
    ("method", "path", "root_path"),
    [
        ("GET", "/health", ""),
        ("POST", "/health", ""),  # 405 from the scan
        ("POST", "/seed_session", ""),
        ("PUT", "/seed_session", ""),
        ("POST", "/step", ""),
        ("GET", "/step", ""),
        ("DELETE", "/any", ""),
        ("POST", "/late", ""),
        ("GET", "/nothing/here", ""),
        ("POST", "/rollouts/r1/step", ""),
        ("POST", "/api/step", "/api"),
        ("POST", "/step\n", ""),
        ("POST", "/step/", ""),
    ],
)
async def test_the_same_route_as_starlettes_scan(method, path, root_path):
    table, scan = RouteTable(ROUTES), Router(ROUTES)
    assert table.by_path.keys() == {"/health", "/seed_session", "/step", "/any"}
    assert await _call(table, method, path, root_path) == await _call(scan, method, path, root_path)
