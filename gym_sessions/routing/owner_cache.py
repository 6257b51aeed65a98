"""A short, bounded cache of who holds which session (Redis claims).

With Redis claims the worker that accepts a request for another worker's
session pays a Redis round trip to learn the holder, on every forwarded
request. `OwnerCache` remembers the answer for `TTL_SECONDS`. A cached answer
is never trusted to serve state: the router forwards on it with the hop mark
`HELD_MARK`, and the worker it names refuses (privately, `NOT_HELD_HEADER`)
unless it holds the session right then, without claiming or serving it. The
sender then drops the entry, asks Redis again and forwards once more; so a
session that moved, closed or was reclaimed elsewhere meanwhile costs one
refused hop, never a stale reply. Entries also go on a close, a 410, a 502
and a refusal. Only the holder's memory is authoritative, as without the cache.

With file claims a lookup is one small file read (6 us p50 against the 0.26 ms
the one-host hop adds, ``benchmarks/LOG.md``): no cache there. With durable
sessions a cached holder that died refuses the hop like any dead holder: the
router looks it up afresh and restores the session (`SessionRouter._forward_cached`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

__all__ = ["DEFAULT_SIZE", "TTL_SECONDS", "OwnerCache"]

#: How long a looked-up holder is reused. Short: every use is checked by the
#: holder anyway, this only bounds how long a moved session costs refusals.
TTL_SECONDS = 2.0
#: Entries at most (least recently used first out).
DEFAULT_SIZE = 4096


class OwnerCache:
    """Session id → holder worker id, for `TTL_SECONDS`, at most ``size`` entries.

    Args:
        ttl: Seconds an entry is used after its lookup.
        size: Entries at most.
        clock: Monotonic clock (tests may pass their own).
    """

    def __init__(
        self,
        ttl: float = TTL_SECONDS,
        size: int = DEFAULT_SIZE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if size < 1 or ttl <= 0:
            raise ValueError("an owner cache needs a positive size and lifetime")
        self.ttl = ttl
        self.size = size
        self._clock = clock
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> str | None:
        """The cached holder of ``session_id``, or ``None`` (never looked up, or too old)."""
        entry = self._entries.get(session_id)
        if entry is None:
            return None
        holder, expires = entry
        if self._clock() >= expires:
            del self._entries[session_id]
            return None
        self._entries.move_to_end(session_id)
        return holder

    def put(self, session_id: str, holder: str) -> None:
        """Remember that a lookup just now found ``holder`` holding ``session_id``."""
        self._entries[session_id] = (holder, self._clock() + self.ttl)
        self._entries.move_to_end(session_id)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Drop the entry of ``session_id`` (closed, refused, gone, released)."""
        self._entries.pop(session_id, None)
