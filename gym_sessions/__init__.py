"""gym-sessions: serve stateful Gymnasium environments from several uvicorn workers.

Importing the package registers ``gym_sessions/Remote-v0``::

    import gymnasium
    import gym_sessions  # noqa: F401  (registers the remote env)

    env = gymnasium.make("gym_sessions/Remote-v0", url="http://127.0.0.1:8000")
"""

from gym_sessions._registration import register_envs
from gym_sessions.errors import (
    GymSessionsError,
    HTTPError,
    ServerUnreachableError,
    SessionClosedError,
    SessionConflictError,
    SessionGoneError,
)
from gym_sessions.settings import Settings

__all__ = [
    "GymSessionsError",
    "HTTPError",
    "ServerUnreachableError",
    "SessionClosedError",
    "SessionConflictError",
    "SessionGoneError",
    "Settings",
    "__version__",
    "register_envs",
]

__version__ = "0.1.0"

register_envs()
