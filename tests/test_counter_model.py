"""The counter agent's scripted chat model (`envs.counter_model`) in process, by ASGI calls."""

from __future__ import annotations

import collections
import json
import random
from typing import Any

import pytest

from envs import counter_model
from envs.counter_model import MISTAKES, mistake_of
from tests.asgi import asgi_request

STEP_TOOL = {
    "type": "function",
    "function": {"name": "step", "parameters": {"properties": {"action": {"type": "integer"}}}},
}


async def call(method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request through the model's Starlette app; its status and JSON reply."""
    raw = b"" if body is None else json.dumps(body).encode()
    reply = await asgi_request(
        counter_model.app, method, path, raw, [(b"content-type", b"application/json")]
    )
    return reply.status, reply.json()


async def play(task: dict[str, Any]) -> list[str]:
    """The tool-call arguments the model gives for ``task``, asked as the agent asks."""
    system = json.dumps({"goal": "add each increment to the counter, in order", "task": task})
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": json.dumps({"observation": task["initial_count"], "info": {}})},
    ]
    count, arguments = task["initial_count"], []
    for _ in task["increments"]:
        status, reply = await call(
            "POST", "/v1/chat/completions", {"messages": messages, "tools": [STEP_TOOL]}
        )
        assert status == 200
        message = reply["choices"][0]["message"]
        (tool_call,) = message["tool_calls"]
        arguments.append(tool_call["function"]["arguments"])
        try:
            count += json.loads(arguments[-1])["action"]
        except ValueError:
            break  # the agent cannot read it: its run ends with 502
        result = json.dumps({"observation": count, "info": {}})
        messages += [message, {"role": "tool", "tool_call_id": tool_call["id"], "content": result}]
    return arguments


def task_with(mistake: str | None) -> dict[str, Any]:
    rng = random.Random(1)
    while True:
        increments = [rng.choice([i for i in range(-9, 10) if i]) for _ in range(5)]
        task = {"initial_count": 3, "increments": increments, "expected_count": 3 + sum(increments)}
        if mistake_of(task)[0] == mistake:
            return task


def test_each_mistake_is_made_on_about_one_task_in_ten_and_always_on_the_same_ones():
    rng = random.Random(0)
    tasks = [
        {
            "initial_count": rng.randint(-20, 20),
            "increments": [rng.randint(-9, 9) for _ in range(4)],
        }
        for _ in range(2000)
    ]
    kinds = collections.Counter(mistake_of(task)[0] for task in tasks)
    assert set(kinds) == {None, *MISTAKES}
    assert all(150 < kinds[kind] < 250 for kind in MISTAKES), kinds
    assert [mistake_of(task) for task in tasks] == [mistake_of(dict(task)) for task in tasks]
    assert all(0 <= step < 4 for _, step in map(mistake_of, tasks))


async def test_a_task_without_a_mistake_is_played_increment_by_increment():
    task = task_with(None)
    assert await play(task) == [json.dumps({"action": i}) for i in task["increments"]]


@pytest.mark.parametrize("mistake", MISTAKES)
async def test_a_mistake_changes_one_tool_call_only(mistake):
    task = task_with(mistake)
    _, at = mistake_of(task)
    arguments = await play(task)
    right = [json.dumps({"action": i}) for i in task["increments"]]
    assert arguments[:at] == right[:at]
    wrong = arguments[at]
    increment = task["increments"][at]
    if mistake == "wrong_sign":
        assert json.loads(wrong) == {"action": -increment}
    elif mistake == "count_as_action":
        count_before = task["initial_count"] + sum(task["increments"][:at])
        assert json.loads(wrong) == {"action": count_before + increment}
    else:
        with pytest.raises(ValueError):
            json.loads(wrong)
    if mistake != "truncated_arguments":
        assert arguments[at + 1 :] == right[at + 1 :]


async def test_conversations_list_each_run_with_its_task_and_last_reply():
    task = task_with("wrong_sign")
    arguments = await play(task)
    status, reply = await call("GET", "/v1/conversations")
    assert status == 200
    (conversation,) = [c for c in reply["conversations"] if c["task"] == task]
    calls = [m for m in conversation["messages"] if m["role"] == "assistant"]
    assert [m["tool_calls"][0]["function"]["arguments"] for m in calls] == arguments
    assert conversation["messages"][-1]["role"] == "assistant"


async def test_a_request_without_the_step_tool_is_refused():
    status, reply = await call("POST", "/v1/chat/completions", {"messages": [], "tools": []})
    assert status == 400
    assert "step" in reply["error"]["message"]
