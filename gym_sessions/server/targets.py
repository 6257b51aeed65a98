"""Turn a ``serve`` TARGET into something to serve.

TARGET is a registered Gymnasium id (``CartPole-v1``) or ``module:attr`` naming
an ``Env`` subclass, a factory returning an env, a `SessionServer` (class or
instance), or an ASGI app.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from typing import Any

import gymnasium as gym

from gym_sessions.errors import StartupError
from gym_sessions.server.base import SessionServer
from gym_sessions.server.env_server import GymEnvServer

__all__ = ["load_target"]


def _import_attr(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise StartupError(f"target {target!r} must look like 'module:attr'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # serve modules from the current directory, as uvicorn does
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise StartupError(f"cannot import module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise StartupError(f"module {module_name!r} has no attribute {attr!r}") from exc
    return obj


def _is_asgi_app(obj: Any) -> bool:
    call = obj if inspect.isfunction(obj) else getattr(obj, "__call__", None)  # noqa: B004
    if call is None or inspect.isclass(obj):
        return False
    try:
        params = inspect.signature(call).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) == 3 and inspect.iscoroutinefunction(call)


def load_target(target: str) -> SessionServer | Any:
    """The server (or ASGI app) that ``target`` names.

    Raises:
        StartupError: the target cannot be found or does not make an environment.
    """
    if ":" not in target:
        try:
            gym.spec(target)
        except gym.error.Error as exc:
            raise StartupError(
                f"{target!r} is not a registered Gymnasium id (or use 'module:attr'): {exc}"
            ) from exc
        return _env_server(functools.partial(gym.make, target), target)

    obj = _import_attr(target)
    if isinstance(obj, SessionServer):
        return obj
    if inspect.isclass(obj) and issubclass(obj, SessionServer):
        return obj()
    if inspect.isclass(obj) and issubclass(obj, gym.Env):
        return _env_server(obj, target)
    if _is_asgi_app(obj):
        return obj
    if callable(obj):
        return _env_server(obj, target)
    raise StartupError(f"target {target!r} is not an Env class, env factory, server or app")


def _env_server(factory: Any, name: str) -> GymEnvServer:
    try:
        return GymEnvServer(factory, name)
    except StartupError:
        raise
    except Exception as exc:
        raise StartupError(f"cannot create an environment from {name!r}: {exc}") from exc
