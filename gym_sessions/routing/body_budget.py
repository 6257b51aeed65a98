"""`BodyBudget`: how much memory request bodies take on one worker at a time.

A body is held from its first byte until its request is answered, and so is
what parsing it made (the parsed JSON lives as long as the handler). Parsing
takes from about 2 to about 25 times a body's size in Python objects
depending on what it holds (docs/operating/limits.md), so the budget counts
neither bytes alone nor a fixed multiple of them: while a body arrives it
holds its bytes, and before it is parsed it holds `body_cost`, an upper bound
of the bytes and the parse together, read off the body's bytes. So whatever
the number of clients and whatever their bodies hold, a worker's bodies take
at most about the budget. A body that does not fit waits briefly for room,
then gets 503 ``overloaded``; one that could never fit gets 413.
"""

from __future__ import annotations

import asyncio

from gym_sessions.errors import BodyTooLargeError, OverloadedError

__all__ = ["BodyBudget", "BodyTicket", "body_cost"]

_MIB = 1 << 20
# What one request costs beyond its body's bytes and objects (scope, parser state).
_FIXED_COST = 64 * 1024
# Upper bounds, in bytes, of what each structural byte of JSON makes when
# parsed (CPython 3.11-3.13, 64-bit): `{` a dict (its table grown as keys
# come), `[` a list (over-allocated as items come), `,` one more item (its
# slot, a float or int object), `"` half of a string object's header, `:`
# a key's table entry and its place in the decoder's key memo. Measured with
# tracemalloc over bodies of each kind (tests/test_body_cost.py).
_OBJECT = 96
_ARRAY = 88
_ITEM = 36
_QUOTE = 24
_KEY = 56
# Besides the objects: the body's bytes, its decoded text and the strings'
# characters, each at most one byte per body byte for ASCII without
# ``\u`` escapes; a non-ASCII character or an escape can widen a whole
# string (and the decoded text) to 4 bytes per character.
_ASCII_COPIES = 3
_WIDE_COPIES = 9


def body_cost(body: bytes) -> int:
    """An upper bound of the memory ``body`` takes once parsed as JSON, its own bytes included.

    Read off the bytes in a few C scans (no parse); correct for any body,
    JSON or not: bytes that are not JSON structure (in strings, or in a binary
    frame's blobs) only make it larger than needed. About 2-4 times the
    actual cost for the cheapest kinds (small integers, one-character
    strings), within 2 times for the rest.
    """
    copies = _ASCII_COPIES if body.isascii() and b"\\u" not in body else _WIDE_COPIES
    return (
        _FIXED_COST
        + copies * len(body)
        + _OBJECT * body.count(b"{")
        + _ARRAY * body.count(b"[")
        + _ITEM * body.count(b",")
        + _QUOTE * body.count(b'"')
        + _KEY * body.count(b":")
    )


class BodyBudget:
    """Memory of request bodies in flight on one worker, at most ``limit`` bytes.

    Args:
        limit: Bytes of memory bodies may take at once (`body_cost` each once read).
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
                    f"this worker's request bodies take {_mib(self.held)} (its budget is "
                    f"{_mib(self.limit)}); try again shortly"
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

    async def cover(self, cost: int) -> None:
        """Hold ``cost`` in all (a read body's `body_cost`): the bytes it lacks.

        Raises:
            BodyTooLargeError: ``cost`` exceeds the whole budget: no wait helps.
            OverloadedError: no room within the budget's wait.
        """
        if cost > self._budget.limit:
            raise BodyTooLargeError(
                f"this body would take about {_mib(cost)} of memory to parse, more than a "
                f"worker spends on request bodies at once ({_mib(self._budget.limit)}, "
                "--max-inflight-body-bytes); send large arrays in the binary encoding, or "
                "split the request"
            )
        if cost > self.size:
            await self.take(cost - self.size)

    def release(self) -> None:
        """Give every byte back (idempotent)."""
        if self.size:
            self._budget._give_back(self.size)
            self.size = 0


def _mib(size: int) -> str:
    return f"{size / _MIB:.1f} MiB"
