"""A monotonic clock that a test moves, so claim windows pass without waiting."""

from __future__ import annotations


class FakeClock:
    """Callable like ``time.monotonic``; its time moves only by `advance`.

    Args:
        start: The first reading (any value: only differences count).
    """

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` forward."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now += seconds
