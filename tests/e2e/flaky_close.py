"""Servers whose release fails a given number of times: for retried closes.

`FlakyCloseEnv` is the counter whose ``close()`` raises the first
``options.fail_closes`` times; `FlakyCloseAgent` is an agent whose close hook
raises the first ``fail_closes`` times (a seed body field) and then reports how
many attempts it took.
"""

from __future__ import annotations

from typing import Any

from envs.counter import CounterEnv
from gym_sessions.server.agent import AgentServer
from gym_sessions.server.policies import Policy, ScriptedPolicy


class FlakyCloseEnv(CounterEnv):
    fail_closes = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        self.fail_closes = int((options or {}).get("fail_closes", 0))
        return super().reset(seed=seed, options=options)

    def close(self) -> None:
        if self.fail_closes > 0:
            self.fail_closes -= 1
            raise RuntimeError("the env's resources could not be released this time")
        super().close()


class FlakyCloseAgent(AgentServer):
    def make_policy(self, body: dict[str, Any], spaces: dict[str, Any]) -> Policy:
        return ScriptedPolicy(body.get("actions", []))

    async def seed_agent_session(self, session_id: str, body: dict[str, Any]) -> Any:
        return {"fail_closes": int(body.get("fail_closes", 0)), "attempts": 0}

    async def close_agent_session(self, session_id: str, state: Any) -> dict[str, Any]:
        state["attempts"] += 1
        if state["attempts"] <= state["fail_closes"]:
            raise RuntimeError("the agent's resources could not be released this time")
        return {"attempts": state["attempts"]}
