"""An agent that plays the ``actions`` of its ``/run`` body: for /run error-path tests."""

from typing import Any

from gym_sessions.server.agent import AgentServer
from gym_sessions.server.policies import Policy, ScriptedPolicy


class ScriptedAgent(AgentServer):
    def make_policy(self, body: dict[str, Any], spaces: dict[str, Any]) -> Policy:
        return ScriptedPolicy(body.get("actions", []))
