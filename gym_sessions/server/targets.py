"""Turn a ``serve`` TARGET into something to serve.

TARGET is a registered Gymnasium id (``CartPole-v1``) or ``module:attr`` naming
an ``Env`` subclass, a factory returning an env, a `SessionServer` (class or
instance), or an ASGI app. A `ServeTarget` also carries ``--env-kwargs``: keyword
arguments for the env class, factory or ``gymnasium.make`` of every session.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import gymnasium as gym

from gym_sessions.errors import StartupError
from gym_sessions.server.base import SessionServer
from gym_sessions.server.env_server import GymEnvServer

__all__ = ["ServeTarget", "load_target"]


class ServeTarget(str):
    """A TARGET string that also carries the env's constructor keyword arguments.

    It is a ``str`` so that it travels wherever a target string already goes:
    `gym_sessions.server.worker.WorkerSpec` holds it, and uvicorn pickles that
    spec into every worker it spawns (pickle keeps a ``str`` subclass's
    attributes), so each worker, replacements and reloads included, makes its
    envs with the same arguments as the supervisor's start-up check did.

    Args:
        target: A registered Gymnasium id or ``module:attr``.
        env_kwargs: Passed to the env class, the factory or ``gymnasium.make``
            for every env the server makes; JSON values, so they pickle.
    """

    env_kwargs: dict[str, Any]

    def __new__(cls, target: str, env_kwargs: Mapping[str, Any] | None = None) -> ServeTarget:
        self = super().__new__(cls, target)
        self.env_kwargs = dict(env_kwargs or {})
        return self


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

    Args:
        target: A registered Gymnasium id or ``module:attr``; a `ServeTarget`
            also gives the env's constructor keyword arguments.

    Raises:
        StartupError: the target cannot be found or does not make an environment
            (with its keyword arguments, if any).
    """
    env_kwargs = target.env_kwargs if isinstance(target, ServeTarget) else {}
    name = str(target)
    if ":" not in name:
        try:
            gym.spec(name)
        except gym.error.Error as exc:
            raise StartupError(
                f"{name!r} is not a registered Gymnasium id (or use 'module:attr'): {exc}"
            ) from exc
        return _env_server(functools.partial(gym.make, name, **env_kwargs), name, env_kwargs)

    obj = _import_attr(name)
    if _is_server_or_app(obj):
        if env_kwargs:
            # A server makes its own sessions' state: there is no env constructor to call.
            raise StartupError(
                f"env kwargs are for an Env class, an env factory or a registered id; "
                f"{name!r} is a server or an app"
            )
        return obj() if inspect.isclass(obj) else obj
    if callable(obj):  # an Env class or a factory
        factory = functools.partial(obj, **env_kwargs) if env_kwargs else obj
        return _env_server(factory, name, env_kwargs)
    raise StartupError(f"target {name!r} is not an Env class, env factory, server or app")


def _is_server_or_app(obj: Any) -> bool:
    if inspect.isclass(obj):
        return issubclass(obj, SessionServer)
    return isinstance(obj, SessionServer) or _is_asgi_app(obj)


def _env_server(factory: Any, name: str, env_kwargs: Mapping[str, Any]) -> GymEnvServer:
    try:
        return GymEnvServer(factory, name)
    except StartupError:
        raise
    except Exception as exc:
        given = f" with env kwargs {json.dumps(env_kwargs)}" if env_kwargs else ""
        raise StartupError(f"cannot create an environment from {name!r}{given}: {exc}") from exc
