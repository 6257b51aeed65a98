"""`BodyBudget`: how many bytes of request bodies one worker holds at a time.

A body is held from its first byte until its request is answered (parsed JSON
lives as long as the handler), and parsing takes up to about 25 times a body's
size in Python objects (docs/operating/limits.md). Bounding the bytes held bounds the
worker's memory for bodies, whatever the number of clients: a request whose
body does not fit waits briefly for room, then gets 503 ``overloaded``.
"""

from __future__ import annotations

import asyncio

from gym_sessions.errors import OverloadedError

__all__ = ["BodyBudget", "BodyTicket"]


class BodyBudget:
    """Bytes of request bodies in flight on one worker, at most ``limit``.

    Args:
        limit: Bytes of bodies held at once.
        wait_seconds: How long a body waits for room before 503 ``overloaded``.
    """

    def __init__(self, limit: int, wait_seconds: float = 2.0) -> None:
        self.limit = limit
        self.wait_seconds = wait_seconds
        self.held = 0
        # Set (and replaced) whenever bytes are given back: waiters look again.
        self._freed = asyncio.Event()

    def ticket(self) -> BodyTicket:
        """A ticket for one request's body; release it when the request is answered."""
        return BodyTicket(self)

    async def _take(self, size: int) -> None:
        if self.held + size > self.limit:
            try:
                async with asyncio.timeout(self.wait_seconds):
                    while self.held + size > self.limit:
                        await self._freed.wait()
            except TimeoutError:
                raise OverloadedError(
                    f"this worker holds {self.held} bytes of request bodies (its limit is "
                    f"{self.limit}); try again shortly"
                ) from None
        self.held += size

    def _give_back(self, size: int) -> None:
        self.held -= size
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()


class BodyTicket:
    """The bytes one request's body holds in a `BodyBudget`."""

    def __init__(self, budget: BodyBudget) -> None:
        self._budget = budget
        self.size = 0

    async def take(self, size: int) -> None:
        """Hold ``size`` more bytes (waits briefly for room).

        Raises:
            OverloadedError: no room within the budget's wait.
        """
        await self._budget._take(size)
        self.size += size

    def release(self) -> None:
        """Give every byte back (idempotent)."""
        if self.size:
            self._budget._give_back(self.size)
            self.size = 0
