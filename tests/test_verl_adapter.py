"""verl's tool interface on a served counter through `gym_sessions.integrations.verl`.

The tools are called by verl's own ``ToolAgentLoop._call_tool`` (create,
execute with the trajectory's ``AgentData``, release, around every call), one
turn's calls at once through ``asyncio.gather`` as ``ToolAgentLoop`` runs them;
several trajectories run concurrently. Each trajectory adds ``ACTION`` per call,
so its verified count must be its start plus ``ACTION * CALLS * TURNS``.
Needs verl (``pip install 'gym-sessions[verl]'``, its own venv: see docs/verl.md).
"""

from __future__ import annotations

import asyncio
import gc
import json
import uuid
from typing import Any

import pytest

pytest.importorskip("verl")
pytest.importorskip("verl.experimental.agent_loop.tool_agent_loop")

from verl.experimental.agent_loop.tool_agent_loop import (
    AgentData,
    ToolAgentLoop,
)
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.tools.base_tool import BaseTool
from verl.tools.tool_registry import initialize_tools_from_config

from gym_sessions.integrations.verl import (
    SessionTool,
    tool_config,
    trajectory_scope,
)
from tests.e2e.test_client_lifecycle import live_sessions

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
ACTION, CALLS, TURNS, TRAJECTORIES = 3, 2, 3, 8


def write_config(url: str, path: Any, **options: Any) -> str:
    """The tool_config YAML verl's trainer reads, made from the server's tools."""
    import yaml

    target = path / "tools.yaml"
    target.write_text(yaml.safe_dump(tool_config(url, **options)))
    return str(target)


def agent_loop(tools: list[BaseTool]) -> ToolAgentLoop:
    """A ``ToolAgentLoop`` with only what ``_call_tool`` reads (no LLM server, no tokenizer)."""
    loop = ToolAgentLoop.__new__(ToolAgentLoop)
    loop.tools = {tool.name: tool for tool in tools}
    loop.max_tool_response_length = 4096
    loop.tool_response_truncate_side = "middle"
    return loop


def agent_data(start: int) -> AgentData:
    create = {"options": {"initial_count": start, "expected_count": start + ACTION * CALLS * TURNS}}
    return AgentData(
        messages=[],
        image_data=None,
        video_data=None,
        audio_data=None,
        mm_processor_kwargs=None,
        metrics={},
        request_id=uuid.uuid4().hex,
        tools_kwargs={"step": {"create_kwargs": create}, "observe": {"create_kwargs": create}},
    )


async def turn(loop: ToolAgentLoop, data: AgentData, calls: list[FunctionCall]) -> list[Any]:
    """One turn's tool calls, as ``ToolAgentLoop._handle_processing_tools_state`` runs them."""
    return await asyncio.gather(*(loop._call_tool(c, data.tools_kwargs, data) for c in calls))


async def trajectory(loop: ToolAgentLoop, start: int) -> tuple[list[Any], list[str]]:
    """One trajectory in a scope: its /verify replies (or errors) and its tool texts."""
    data = agent_data(start)
    step = FunctionCall(name="step", arguments=json.dumps({"action": ACTION}))
    texts: list[str] = []
    async with trajectory_scope() as scope:
        for _ in range(TURNS):
            texts += [r[0].text for r in await turn(loop, data, [step] * CALLS)]
        texts += [
            r[0].text
            for r in await turn(loop, data, [FunctionCall(name="observe", arguments="{}")])
        ]
    return scope.verifications, texts


def run_trajectories(url: str, tmp_path: Any) -> tuple[list[int], list[list[Any]], list[list[str]]]:
    tools = initialize_tools_from_config(write_config(url, tmp_path, keep_alive=False))
    loop = agent_loop(tools)
    starts = [10 * i for i in range(TRAJECTORIES)]

    async def main() -> list[tuple[list[Any], list[str]]]:
        return await asyncio.gather(*(trajectory(loop, start) for start in starts))

    results = asyncio.run(main())
    return starts, [r[0] for r in results], [r[1] for r in results]


def test_tool_config_lists_the_servers_tools_as_verl_tools(serve, tmp_path):
    server = serve(COUNTER)
    tools = initialize_tools_from_config(write_config(server.url, tmp_path))
    assert all(isinstance(tool, SessionTool) and isinstance(tool, BaseTool) for tool in tools)
    assert {tool.name for tool in tools} == {"step", "observe"}
    step = {tool.name: tool for tool in tools}["step"].tool_schema.function
    assert step.parameters.required == ["action"]
    action = step.parameters.properties["action"]
    assert action.type == "integer"
    assert "(>= -10, <= 10)" in (action.description or "")
    # A config entry without tool_schema: the tool asks the server for it.
    asked = SessionTool({"type": "native", "url": server.url, "tool": "step"}, None)
    assert asked.tool_schema.function == step
    assert live_sessions(server, 1) == 0


def test_each_trajectorys_calls_reach_its_own_session(serve, tmp_path):
    server = serve(COUNTER, workers=4)
    starts, verifications, texts = run_trajectories(server.url, tmp_path)
    total = ACTION * CALLS * TURNS
    assert all(isinstance(v, dict) for vs in verifications for v in vs), verifications
    assert [len(vs) for vs in verifications] == [1] * TRAJECTORIES
    replies = [vs[0] for vs in verifications]
    assert [r["count"] for r in replies] == [start + total for start in starts]
    assert [r["reward"] for r in replies] == [1.0] * TRAJECTORIES
    assert len({r["session_id"] for r in replies}) == TRAJECTORIES
    observed = [json.loads(t[-1]) for t in texts]
    assert observed == [{"observation": s + total, "episode_length": CALLS * TURNS} for s in starts]
    assert not any("Error" in text for t in texts for text in t), texts
    assert live_sessions(server, 4) == 0


def test_calc_reward_is_verify_and_a_collected_trajectory_closes_its_session(serve, tmp_path):
    server = serve(COUNTER, workers=4)
    tools = initialize_tools_from_config(write_config(server.url, tmp_path, keep_alive=False))
    loop = agent_loop(tools)
    step = loop.tools["step"]

    async def main() -> tuple[float, float]:
        scored = agent_data(5)
        call = FunctionCall(name="step", arguments=json.dumps({"action": ACTION}))
        for _ in range(CALLS * TURNS):
            await turn(loop, scored, [call])
        instance_id, _ = await step.create(create_kwargs={})
        reward = await step.calc_reward(instance_id, agent_data=scored)
        await step.release(instance_id)
        # No scope (verl's plain tool_agent loop): the session closes with its AgentData.
        unscored = agent_data(0)
        await turn(loop, unscored, [call])
        assert live_sessions(server, 4) == 1
        del unscored
        gc.collect()
        wrong = agent_data(1)
        await turn(loop, wrong, [call])
        wrong_reward = await step.calc_reward("any", agent_data=wrong)
        return reward, wrong_reward

    reward, wrong_reward = asyncio.run(main())
    assert (reward, wrong_reward) == (1.0, 0.0)
    assert live_sessions(server, 4) == 0


def test_counts_are_wrong_without_routing(serve, tmp_path):
    server = serve(COUNTER, "--no-routing", workers=4)
    starts, verifications, _ = run_trajectories(server.url, tmp_path)
    total = ACTION * CALLS * TURNS
    right = [
        start
        for start, vs in zip(starts, verifications, strict=True)
        if vs and isinstance(vs[0], dict) and vs[0]["count"] == start + total
    ]
    print(f"\n--no-routing: {len(right)} of {TRAJECTORIES} trajectories ended with the right count")
    assert len(right) < TRAJECTORIES // 2
