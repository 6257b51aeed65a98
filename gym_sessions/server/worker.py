"""Entry point of a worker process started by uvicorn's multi-process supervisor.

The supervisor (``gym-sessions serve``) puts the target and the settings,
including the secret and the runtime directory, in ``GYM_SESSIONS_WORKER``;
uvicorn imports `app_from_environment` in every worker, replacements included.
"""

from __future__ import annotations

import json
import os

from gym_sessions.server.app import create_app
from gym_sessions.server.targets import load_target
from gym_sessions.settings import Settings

__all__ = ["WORKER_ENV", "app_from_environment", "worker_environment"]

WORKER_ENV = "GYM_SESSIONS_WORKER"


def worker_environment(target: str, settings: Settings) -> str:
    """The ``GYM_SESSIONS_WORKER`` value handing ``target`` and ``settings`` to workers."""
    return json.dumps({"target": target, "settings": json.loads(settings.to_json())})


def app_from_environment():  # type: ignore[no-untyped-def]
    """Build this worker's app from ``GYM_SESSIONS_WORKER`` (a uvicorn app factory)."""
    spec = json.loads(os.environ[WORKER_ENV])
    served = load_target(spec["target"])
    settings = Settings(**spec["settings"])
    if callable(served) and not hasattr(served, "bind"):
        return served  # an ASGI app served as it is
    return create_app(served, settings)
