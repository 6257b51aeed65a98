"""What a server author needs: the resources-server base, the Gymnasium adapter,
agent servers, tools, body schemas, policies, and a way to start a server from Python.

Everything a server is built from is importable from here::

    from gym_sessions.server import ResourcesServer, tool, start_server

Modules below this package are internal: their names may change between
releases (``docs/design.md`` describes how they fit together).
"""

from typing import TYPE_CHECKING

from gym_sessions._lazy_names import lazy_names
from gym_sessions.server.app import WorkerApp, create_app
from gym_sessions.server.base import SessionServer
from gym_sessions.server.bodies import BodySchema, Field, integer_list, read_json
from gym_sessions.server.env_server import GymEnvServer, env_capture_method
from gym_sessions.server.process import ServerProcess, start_server
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool, ToolHandler

if TYPE_CHECKING:
    from gym_sessions.server.agent import AgentServer
    from gym_sessions.server.policies import (
        ChatCompletionsPolicy,
        Policy,
        ScriptedPolicy,
        StopEpisode,
    )

# Agent servers and policies (with their aiohttp client) load on first use:
# the workers of an env or resources server never need them.
_LAZY_MODULES = {
    "AgentServer": "gym_sessions.server.agent",
    "ChatCompletionsPolicy": "gym_sessions.server.policies",
    "Policy": "gym_sessions.server.policies",
    "ScriptedPolicy": "gym_sessions.server.policies",
    "StopEpisode": "gym_sessions.server.policies",
}


__all__ = [
    "AgentServer",
    "BodySchema",
    "ChatCompletionsPolicy",
    "Field",
    "GymEnvServer",
    "Policy",
    "ResourcesServer",
    "ScriptedPolicy",
    "ServerProcess",
    "SessionServer",
    "StopEpisode",
    "Tool",
    "ToolHandler",
    "WorkerApp",
    "create_app",
    "env_capture_method",
    "integer_list",
    "read_json",
    "session_id",
    "start_server",
]

__getattr__, __dir__ = lazy_names(globals(), _LAZY_MODULES, __all__)
