"""TRL's GRPOTrainer on a served counter through `gym_sessions.integrations.trl`.

A real ``trl.GRPOTrainer`` on CPU with a tiny random Qwen2 and a tokenizer
built here (`envs.trl_counter`); the model's tool calls are forced inside
TRL's own ``generate`` call, everything after that is TRL's code. Each
completion calls ``step(3)`` twice on its own session, so every session's
verified count must be its start plus 6.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from gym_sessions.errors import GymSessionsError
from tests.conftest import import_extra_or_skip
from tests.e2e.test_client_lifecycle import live_sessions

trl = import_extra_or_skip("trl", "trl")
datasets = import_extra_or_skip("datasets", "trl")
get_json_schema = import_extra_or_skip("transformers.utils", "trl").get_json_schema

from envs.trl_counter import force_tool_calls, tiny_model, tiny_tokenizer  # noqa: E402
from gym_sessions.integrations.trl import environment_class  # noqa: E402

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
ACTION, CALLS, STEPS, GENERATIONS = 3, 2, 2, 8
STARTS = (10, 20)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")


def train(url: str, tmp_path) -> tuple[Any, list[dict[str, Any] | None], type]:
    """Run STEPS GRPO steps; returns the trainer, each get_reward's /verify reply, the class."""
    # A new connection per request, so requests land on any worker: the routing does
    # the rest (with one kept-alive connection per session even --no-routing would pass).
    counter = environment_class(url, keep_alive=False, name="Counter")
    verified: list[dict[str, Any] | None] = []

    class Recorded(counter):  # type: ignore[misc, valid-type]
        def get_reward(self) -> float | None:
            try:
                reward = super().get_reward()
            except GymSessionsError:  # a misrouted verify: unscored, so the run goes on
                verified.append(None)
                return None
            verified.append({**(self.verification or {}), "session_id": self.session_id})
            return reward

    rows = [
        {
            "prompt": [{"role": "user", "content": "Add 3 twice. The count is "}],
            "options": {"initial_count": start, "expected_count": start + ACTION * CALLS},
        }
        for start in STARTS
    ]
    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)
    force_tool_calls(model, tokenizer, ACTION, CALLS)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=GENERATIONS,
        num_generations=GENERATIONS,
        max_completion_length=256,
        max_tool_calling_iterations=CALLS,
        max_steps=STEPS,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(rows),
        environment_factory=Recorded,
    )
    trainer.train()
    return trainer, verified, Recorded


def test_tool_schemas_are_the_servers(serve):
    server = serve(COUNTER)
    counter = environment_class(server.url)
    env = counter()
    listed = {tool["name"]: tool for tool in counter.tool_schemas}
    assert set(listed) == {"step", "observe"}
    for name, tool in listed.items():
        schema = get_json_schema(getattr(env, name))["function"]
        assert schema["name"] == name
        assert schema["description"] == tool["description"]
        wanted = tool["inputSchema"]
        assert set(schema["parameters"]["properties"]) == set(wanted["properties"])
        assert schema["parameters"].get("required", []) == wanted.get("required", [])
    action = get_json_schema(env.step)["function"]["parameters"]["properties"]["action"]
    assert action == {
        "type": "integer",
        "description": "an element of the action space (>= -10, <= 10)",
    }
    assert env.reset(prompt=[], options={"initial_count": 4}) == "4"
    with pytest.raises(TypeError):
        env.step(1, 2)
    counter.close_all()
    assert live_sessions(server, 1) == 0


@pytest.mark.slow
def test_grpo_tool_calls_reach_their_own_sessions(serve, tmp_path):
    server = serve(COUNTER, workers=4)
    began = time.monotonic()
    trainer, verified, recorded = train(server.url, tmp_path)
    print(f"\nGRPO {STEPS} steps x {GENERATIONS} generations: {time.monotonic() - began:.1f} s")
    assert len(verified) == STEPS * GENERATIONS
    assert all(v is not None for v in verified)
    assert len({v["session_id"] for v in verified}) == STEPS * GENERATIONS  # type: ignore[index]
    # Rows are taken in the sampler's order: each step's 8 sessions share one start.
    counts = [v["count"] for v in verified]  # type: ignore[index]
    for step in range(STEPS):
        batch = counts[step * GENERATIONS : (step + 1) * GENERATIONS]
        assert len(set(batch)) == 1 and batch[0] - ACTION * CALLS in STARTS, counts
    logged = [e for e in trainer.state.log_history if "rewards/Recorded/mean" in e]
    assert len(logged) == STEPS
    for step, entry in enumerate(logged):
        rewards = [v["reward"] for v in verified[step * GENERATIONS : (step + 1) * GENERATIONS]]  # type: ignore[index]
        assert entry["rewards/Recorded/mean"] == pytest.approx(sum(rewards) / len(rewards))
        assert entry["tools/call_frequency"] == CALLS
        assert entry["tools/failure_frequency"] == 0
    last = [v["reward"] for v in verified[-GENERATIONS:]]  # type: ignore[index]
    assert list(trainer._logs["rewards"]["Recorded"]) == last == [1.0] * GENERATIONS
    recorded.close_all()
    assert live_sessions(server, 4) == 0


@pytest.mark.slow
def test_grpo_counts_are_wrong_without_routing(serve, tmp_path):
    server = serve(COUNTER, "--no-routing", workers=4)
    _, verified, _ = train(server.url, tmp_path)
    right = [v for v in verified if v is not None and v["count"] - ACTION * CALLS in STARTS]
    print(f"\n--no-routing: {len(right)} of {len(verified)} sessions ended with the right count")
    assert len(right) < len(verified) // 2
