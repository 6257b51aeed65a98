"""A worker's own claims and their lifetimes (DESIGN 3.4).

The claimant keeps its claims in memory, so a request for one of its own
sessions reads no file. Each claim knows whether its session is open and how
many requests for it are in flight; a background sweep ends the claims whose
session has not been open for ``window`` seconds since its last request, even
when no request comes. Only the claimant removes a claim, and never while a
request for it is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from gym_sessions.routing.claim_store import ClaimStore

__all__ = ["OwnedClaims"]

logger = logging.getLogger("gym_sessions.routing")


@dataclass
class _Claim:
    idle_since: float
    open: bool = False
    in_flight: int = 0
    release_when_idle: bool = False


class OwnedClaims:
    """The claims this worker holds, on top of the shared `ClaimStore`.

    Args:
        store: The shared claim store.
        worker_id: This worker's id.
        window: ``session_close_retry_window_seconds``.
        clock: Monotonic clock (tests may pass their own).
    """

    def __init__(
        self,
        store: ClaimStore,
        worker_id: str,
        window: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.worker_id = worker_id
        self.window = window
        self._clock = clock
        self._claims: dict[str, _Claim] = {}
        self._release_hooks: list[Callable[[str], None]] = []

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._claims

    def __len__(self) -> int:
        return len(self._claims)

    def on_release(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(session_id)`` whenever a claim of this worker ends."""
        self._release_hooks.append(hook)

    def holds(self, session_id: str) -> bool:
        """Whether this worker holds the claim and means to keep it past this request."""
        claim = self._claims.get(session_id)
        return claim is not None and not claim.release_when_idle

    def owner(self, session_id: str) -> str | None:
        """The worker that claims ``session_id``: this one from memory, others from the store."""
        if session_id in self._claims:
            return self.worker_id
        return self.store.read(session_id)

    def claim(self, session_id: str) -> str | None:
        """Claim ``session_id`` here; ``None`` on success, else the other claimant's id."""
        if session_id in self._claims:
            return None
        other = self.store.create(session_id)
        if other is None:
            self._claims[session_id] = _Claim(idle_since=self._clock())
        return other

    def enter(self, session_id: str) -> None:
        """A request for a claimed session starts being served here."""
        self._claims[session_id].in_flight += 1

    def leave(self, session_id: str) -> None:
        """A request entered with `enter` is done."""
        claim = self._claims.get(session_id)
        if claim is not None:
            claim.in_flight -= 1
            claim.idle_since = self._clock()
            if claim.release_when_idle and claim.in_flight == 0:
                self._release(session_id)

    def mark_open(self, session_id: str) -> None:
        """The session started successfully: its claim lasts until it stops being open."""
        claim = self._claims.get(session_id)
        if claim is not None:
            claim.open = True
            claim.release_when_idle = False

    def mark_not_open(self, session_id: str) -> None:
        """The session was closed, verified or ended: its window starts after its last request."""
        claim = self._claims.get(session_id)
        if claim is not None:
            claim.open = False
            claim.idle_since = self._clock()

    def drop_unclaimed_state(self, session_id: str) -> None:
        """Run the release hooks for a session this worker served but could not claim.

        A handler may have created state for it before another worker's claim
        turned the reply into a 409; nothing would ever release that state.
        """
        if session_id not in self._claims:
            self._run_release_hooks(session_id)

    def release_now(self, session_id: str) -> None:
        """End the claim at once, or as soon as its last in-flight request is done.

        For servers that decide a claim's end themselves: an agent whose seed
        created nothing, or that dropped a session's last record.
        """
        claim = self._claims.get(session_id)
        if claim is None:
            return
        if claim.in_flight == 0:
            self._release(session_id)
        else:
            claim.open = False
            claim.release_when_idle = True

    def sweep(self) -> list[str]:
        """End every claim whose window has passed; returns the ended session ids."""
        deadline = self._clock() - self.window
        expired = [
            sid
            for sid, claim in self._claims.items()
            if not claim.open and claim.in_flight == 0 and claim.idle_since <= deadline
        ]
        for sid in expired:
            self._release(sid)
        return expired

    def _release(self, session_id: str) -> None:
        del self._claims[session_id]
        self.store.remove(session_id)
        self._run_release_hooks(session_id)

    def _run_release_hooks(self, session_id: str) -> None:
        for hook in self._release_hooks:
            try:
                hook(session_id)
            except Exception:
                logger.exception("releasing the state of session %r failed", session_id)

    async def run_sweeper(self) -> None:
        """Sweep in the background until cancelled."""
        interval = min(1.0, max(0.02, self.window / 10))
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except Exception:  # a failing store must not stop every later sweep
                logger.exception("sweeping expired claims failed")
