"""`ClosedResourcesSessionRecords`: closed session ids, remembered for the window."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["ClosedResourcesSessionRecords"]


class ClosedResourcesSessionRecords:
    """Closed resources sessions, each kept ``window`` seconds from its first close.

    While a record lasts, a late or retried start of that id is refused. The
    record never outlives the session's claim, which lasts a window after the
    session's last request, so the holder is always the worker that remembers.
    """

    def __init__(self, window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        self._closed_at: OrderedDict[str, float] = OrderedDict()
        self._expired: set[str] = set()

    def _forget_expired(self) -> None:
        deadline = self._clock() - self.window
        while self._closed_at:
            sid, closed_at = next(iter(self._closed_at.items()))
            if closed_at > deadline:
                break
            del self._closed_at[sid]
            self._expired.discard(sid)

    def __contains__(self, session_id: str) -> bool:
        self._forget_expired()
        return session_id in self._closed_at

    def __len__(self) -> int:
        self._forget_expired()
        return len(self._closed_at)

    def add(self, session_id: str, *, expired: bool = False) -> bool:
        """Record a close; ``True`` if this is the id's first close within the window.

        Args:
            session_id: The session.
            expired: The server closed it because it idled out (not its client).
        """
        if session_id in self:
            return False
        self._closed_at[session_id] = self._clock()
        if expired:
            self._expired.add(session_id)
        return True

    def expired(self, session_id: str) -> bool:
        """Whether the recorded close was the server's, for idling out."""
        return session_id in self and session_id in self._expired
