"""Time steps through OpenEnv's async ``EnvClient`` (OpenEnv's venv only; see openenv_peer.py).

python driver.py URL STEPS WARMUP   -> one JSON line: per-step seconds, CPU seconds
python driver.py URL --concurrent SESSIONS STEPS
                                    -> one JSON line: wall seconds of SESSIONS concurrent
                                       clients, each reset and STEPS steps, counts checked
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from counter_app import CounterAction, CounterObservation
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import State


class CounterClient(EnvClient[CounterAction, CounterObservation, State]):
    def _step_payload(self, action: CounterAction) -> dict[str, Any]:
        return {"delta": action.delta}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[CounterObservation]:
        data = payload.get("observation", {})
        observation = CounterObservation(
            count=data.get("count", 0),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(
            observation=observation, reward=payload.get("reward"), done=payload.get("done", False)
        )

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))


async def main(url: str, steps: int, warmup: int) -> dict[str, Any]:
    async with CounterClient(base_url=url) as client:
        await client.reset(initial_count=0)
        for _ in range(warmup):
            await client.step(CounterAction(delta=1))
        times = []
        cpu = time.process_time()
        for _ in range(steps):
            started = time.perf_counter()
            result = await client.step(CounterAction(delta=1))
            times.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        assert result.observation.count == warmup + steps, result.observation.count
    return {"step_seconds": times, "cpu_seconds": cpu}


async def concurrent(url: str, sessions: int, steps: int) -> dict[str, Any]:
    async def play(index: int) -> bool:
        async with CounterClient(base_url=url) as client:
            result = await client.reset(initial_count=index)
            for _ in range(steps):
                result = await client.step(CounterAction(delta=1))
            return bool(result.observation.count == index + steps)

    started = time.perf_counter()
    correct = await asyncio.gather(*(play(i) for i in range(sessions)))
    return {"wall_seconds": time.perf_counter() - started, "correct": sum(correct)}


if __name__ == "__main__":
    if sys.argv[2] == "--concurrent":
        url, sessions, steps = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
        print(json.dumps(asyncio.run(concurrent(url, sessions, steps))))
    else:
        url, steps, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        print(json.dumps(asyncio.run(main(url, steps, warmup))))
