"""`RouteTable`: Starlette's ``Router`` with a dictionary in front for fixed paths.

Starlette's router tries each route's regex in turn; a server's tool route
comes after its health, start, verify, close and other routes, so ``/step``
paid about ten regex matches per request. A request whose path is one of the
plain paths at the head of the route list (no path parameters, before any
other kind of route) goes straight to the first of its routes that takes its
method, which is the route the scan would have found. Anything else (other
methods, the ``/rollouts/{rollout_id}`` mount, unknown paths, redirects) goes
through Starlette's scan as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette._utils import get_route_path
from starlette.routing import BaseRoute, Route, Router
from starlette.types import Lifespan, Receive, Scope, Send

__all__ = ["RouteTable"]


class RouteTable(Router):
    """A Starlette ``Router`` whose plain leading routes are found by their path.

    Args:
        routes: The routes, in Starlette's order of precedence.
        lifespan: As for Starlette's ``Router``.
    """

    def __init__(self, routes: Sequence[BaseRoute], lifespan: Lifespan | None = None) -> None:
        super().__init__(list(routes), lifespan=lifespan)
        self.by_path: dict[str, list[Route]] = {}
        for route in self.routes:
            if type(route) is not Route or route.param_convertors:
                break  # the scan may match this one first: later paths are not known
            self.by_path.setdefault(route.path, []).append(route)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            for route in self.by_path.get(get_route_path(scope), ()):
                if route.methods is None or scope["method"] in route.methods:
                    # What the scan sets for a full match of a route without parameters.
                    scope.setdefault("router", self)
                    scope["route"] = route
                    scope["endpoint"] = route.endpoint
                    scope["path_params"] = dict(scope.get("path_params", {}))
                    await route.handle(scope, receive, send)
                    return
        await super().app(scope, receive, send)
