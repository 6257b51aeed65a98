"""`SessionLocks`: one `asyncio.Lock` per session id, for requests that must not interleave."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["SessionLocks"]


class SessionLocks:
    """A lock per id, kept only while a request holds or waits for it.

    Starts and closes whose hooks await would otherwise interleave: two retries
    of one seed would both run the start hook, and the second would restart
    what the first made.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str) -> AsyncIterator[None]:
        """Hold ``session_id``'s lock for the ``async with`` block."""
        lock, users = self._locks.get(session_id, (asyncio.Lock(), 0))
        self._locks[session_id] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[session_id]
            if users == 1:
                del self._locks[session_id]
            else:
                self._locks[session_id] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._locks)
