"""Wait for a condition, bounded in time: one place for the tests' poll loops."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

__all__ = ["eventually", "wait_for"]


def wait_for(check: Callable[[], Any], within: float, step: float = 0.05) -> Any:
    """Call ``check()`` every ``step`` s until it is truthy or ``within`` s pass; its last value."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(step)


async def eventually(check: Callable[[], Any], within: float = 10.0, step: float = 0.05) -> Any:
    """As `wait_for`, without blocking the loop; ``check`` may be sync or async."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(step)
