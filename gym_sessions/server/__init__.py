"""Servers: the app factory, the resources-server base and the Gymnasium adapter."""

from gym_sessions.server.app import WorkerApp, create_app
from gym_sessions.server.env_server import GymEnvServer
from gym_sessions.server.resources import ResourcesServer, session_id

__all__ = ["GymEnvServer", "ResourcesServer", "WorkerApp", "create_app", "session_id"]
