"""``gym-sessions demo``: serve the counter env on several workers and score episodes on it.

The demo starts a real ``gym-sessions serve gym_sessions.examples.counter:CounterEnv`` process,
runs a batch of counter episodes through ``gym_sessions/Remote-v0`` clients, and
scores each one. The counter keeps its count in the worker that started the
session, so an episode scores 1.0 only if every one of its requests reached that
worker. It runs the batch twice: with one kept-alive connection per session
(requests stay on the accepting worker), and with a new connection per request
(requests land on any worker and must be routed to the one holding the session).
"""

from __future__ import annotations

import contextlib
import functools
import json
import random
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import gymnasium as gym

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.errors import StartupError
from gym_sessions.server.process import ServerProcess, start_server

__all__ = ["run_demo"]

TARGET = "gym_sessions.examples.counter:CounterEnv"
AGENT_TARGET = "gym_sessions.examples.counter_agent:CounterAgent"
REQUEST_TIMEOUT_SECONDS = 60.0
HEALTH_PROBES = 50


@dataclass(frozen=True)
class CounterTask:
    """One episode: start at ``initial_count``, add each increment, expect the sum."""

    initial_count: int
    increments: tuple[int, ...]

    @property
    def expected_count(self) -> int:
        return self.initial_count + sum(self.increments)


@dataclass
class BatchResult:
    """Rewards and errors of one batch of episodes."""

    title: str
    episodes: int
    rewards: Counter[float] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def perfect(self) -> int:
        return self.rewards[1.0]


def _random_tasks(count: int, rng: random.Random) -> list[CounterTask]:
    return [
        CounterTask(
            rng.randint(-50, 50),
            tuple(rng.randint(-10, 10) for _ in range(rng.randint(3, 8))),
        )
        for _ in range(count)
    ]


@contextlib.contextmanager
def _exit_on_sigterm() -> Iterator[None]:
    """Turn SIGTERM into SystemExit, so ``finally`` blocks stop the server on the way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def exit_now(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_now)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_episode(url: str, task: CounterTask, keep_alive: bool) -> float:
    env = gym.make(
        "gym_sessions/Remote-v0", url=url, keep_alive=keep_alive, timeout=REQUEST_TIMEOUT_SECONDS
    )
    try:
        env.reset(
            options={"initial_count": task.initial_count, "expected_count": task.expected_count}
        )
        for increment in task.increments:
            env.step(increment)
        return float(env.unwrapped.verify()["reward"])  # type: ignore[attr-defined]
    finally:
        env.close()


def _score(
    title: str, tasks: list[CounterTask], concurrency: int, play: Callable[[CounterTask], float]
) -> BatchResult:
    """Play every task on ``concurrency`` threads; count rewards and errors."""
    result = BatchResult(title, len(tasks))
    started = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        for future in [pool.submit(play, task) for task in tasks]:
            try:
                result.rewards[future.result()] += 1
            except Exception as exc:
                result.errors[type(exc).__name__] += 1
    finally:
        # On Ctrl-C or SIGTERM, drop the episodes not yet started.
        pool.shutdown(wait=True, cancel_futures=True)
    result.seconds = time.perf_counter() - started
    return result


def _run_with_agent(agent_url: str, env_url: str, task: CounterTask) -> float:
    """One task through the counter agent's ``/run`` (agent and env both routed)."""
    body = {
        "env_url": env_url,
        "task": {
            "initial_count": task.initial_count,
            "increments": list(task.increments),
            "expected_count": task.expected_count,
        },
    }
    request = urllib.request.Request(
        agent_url + "/run",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS) as reply:
        return float(json.loads(reply.read())["reward"])


def _worker_spread(server: ServerProcess) -> str:
    # Each probe is a new connection, which any worker may accept.
    try:
        seen = Counter(server.health()["worker"] for _ in range(HEALTH_PROBES))
    except (OSError, ValueError, KeyError) as exc:
        return f"/health probes failed: {exc!r}"
    return f"/health on {HEALTH_PROBES} new connections answered by {len(seen)} worker(s)"


def _format_counts(counts: Counter[Any]) -> str:
    return ", ".join(f"{key}: {n}" for key, n in sorted(counts.items())) or "none"


def _print_batch(result: BatchResult) -> None:
    rate = result.episodes / result.seconds if result.seconds > 0 else 0.0
    print(f"\n{result.title}")
    print(f"  episodes    {result.episodes}")
    print(f"  reward 1.0  {result.perfect}/{result.episodes}")
    print(f"  rewards     {_format_counts(result.rewards)}")
    print(f"  errors      {_format_counts(result.errors)}")
    print(f"  wall time   {result.seconds:.2f} s ({rate:.1f} episodes/s)", flush=True)


def _start(target: str, workers: int, *args: str) -> ServerProcess:
    try:
        return start_server(target, *args, workers=workers)
    except RuntimeError as exc:
        raise StartupError(f"the demo's {target} server did not start: {exc}") from exc


def run_demo(workers: int, episodes: int, concurrency: int) -> int:
    """Serve the counter env with ``workers`` workers and score ``episodes`` episodes twice.

    Returns:
        0 if every episode of both batches scored 1.0, else 1.

    Raises:
        StartupError: the server did not start.
    """
    if workers < 1 or episodes < 1 or concurrency < 1:
        raise ValueError("--workers, --episodes and --concurrency must be at least 1")
    batches = [
        ("one kept-alive connection per session (keep_alive=True)", True),
        ("a new connection per request (keep_alive=False): every request is routed", False),
    ]
    tasks = _random_tasks(episodes, random.Random())
    results: list[BatchResult] = []
    with _exit_on_sigterm(), _start(TARGET, workers) as server:
        print(f"server   {' '.join(server.process.args)}")  # type: ignore[arg-type]
        print(f"url      {server.url}")
        print(f"workers  {workers}")
        print(f"clients  {concurrency} threads of gymnasium.make('gym_sessions/Remote-v0')")
        for title, keep_alive in batches:
            play = functools.partial(_run_episode, server.url, keep_alive=keep_alive)
            results.append(_score(title, tasks, concurrency, play))
            _print_batch(results[-1])
        print(f"\n{_worker_spread(server)}")
        # The agent may call this env server and no other (docs/security.md).
        with _start(AGENT_TARGET, workers, "--allow-env", server.url) as agent:
            print(f"\nagent    {' '.join(agent.process.args)}")  # type: ignore[arg-type]
            title = "the same tasks through the counter agent's /run (agent and env routed)"
            play = functools.partial(_run_with_agent, agent.url, server.url)
            results.append(_score(title, tasks, concurrency, play))
            _print_batch(results[-1])
    total = sum(result.episodes for result in results)
    failed = total - sum(result.perfect for result in results)
    if failed:
        print(f"\nFAILED: {failed} of {total} episodes did not score 1.0")
        return 1
    print(f"\nOK: all {total} episodes scored 1.0")
    return 0
