"""Where claims live: which worker holds which session.

A `ClaimStore` is shared by every worker of a deployment. Two implementations:

- `FileClaimStore` (``claims = "file"``, one host): one file per claimed
  session under the runtime directory's ``claims/``. The name is a hash of the
  session id (never a path built from it); the content is the holder's
  worker id. A claim is created by hard-linking a complete temporary file into
  place: the link fails if the claim exists, so two workers never both hold an
  id, and a reader never sees half a claim. Files end with the server.
  With durable sessions, the holder of a claim whose holder died can be
  replaced by exactly one other worker (`FileClaimStore.take_over`).
- `RedisClaimStore` (``claims = "redis://..."``, several hosts; in
  `gym_sessions.routing.redis_claims`): one key per claim, created with
  ``SET NX``; a claim that is not open expires by itself.

`LocalClaimStore` is the one-worker store: it writes nothing.

The methods are coroutines so a networked store never blocks the event loop;
the file store does its (local, microsecond) work synchronously inside them.
A store that cannot answer raises `ClaimsUnavailableError` (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from gym_sessions.errors import OverloadedError, out_of_resources
from gym_sessions.routing.keys import claim_name
from gym_sessions.runtime_dir import worker_process_exists

if TYPE_CHECKING:
    from gym_sessions.routing.snapshot_store import FileSnapshotStore

__all__ = ["ClaimStore", "FileClaimStore", "LocalClaimStore"]


class ClaimStore(Protocol):
    """Shared record of which worker claims which session.

    ``expires`` says whether claims in this store carry an expiry of their own
    (`hold` / `expire` matter); stores whose claims end with the server set it
    to ``False`` and are never asked.
    """

    expires: bool

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        """Claim ``session_id`` for this worker.

        Returns ``None`` when the claim was created, else the worker id of the
        worker that holds it (this worker's own id if the store still has an
        earlier claim of this worker). ``restoring``: this worker is writing
        back a claim it holds in memory after the store lost it.
        """

    async def read(self, session_id: str) -> str | None:
        """The worker id that claims ``session_id``, or ``None``."""

    async def remove(self, session_id: str) -> None:
        """Remove this worker's claim of ``session_id`` (never another worker's)."""

    async def hold(self, session_id: str) -> bool:
        """Keep this worker's claim without expiry; ``False`` if another worker holds it now."""

    async def expire(self, session_id: str, seconds: float) -> bool:
        """Let this worker's claim end by itself ``seconds`` from now.

        Writes the claim again if it is gone; ``False`` if another worker holds it.
        """

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        """Replace ``dead_holder``'s claim of ``session_id`` by this worker's.

        Returns ``None`` when this worker holds the claim now; else the worker
        the claim names (``dead_holder`` itself if the takeover could not be
        made). Of any number of workers calling this at once, exactly one wins.
        The caller must know ``dead_holder`` is gone (`holder_exited`).
        """

    async def holder_exited(self, worker_id: str) -> bool:
        """Whether ``worker_id``, which just refused a connection, is known to have exited.

        Only then may its claims be taken over (a slow worker never is).
        """


@contextlib.contextmanager
def _overloaded_on_exhaustion() -> Iterator[None]:
    # Out of descriptors (EMFILE) is a passing state of this worker: a JSON 503
    # the client may retry, never a crash or a plain-text 500.
    try:
        yield
    except OSError as exc:
        if out_of_resources(exc):
            raise OverloadedError(f"this worker is short of resources: {exc.strerror}") from exc
        raise


# A takeover under way elsewhere takes microseconds (no awaits, local files):
# a loser polls this long for the winner's claim before it gives up (410).
_TAKEOVER_WAIT_SECONDS = 2.0
# A worker that stopped listening exits within its shutdown's last steps
# (closing the forwarder, releasing sessions): well under this.
_EXIT_WAIT_SECONDS = 5.0


class FileClaimStore:
    """Claims as files in a directory shared by the workers of one server.

    Args:
        claims_dir: The runtime directory's ``claims/``.
        worker_id: This worker's id (the content of its claims).
        snapshots: Durable sessions' snapshots, removed with their claims.
    """

    expires = False

    def __init__(
        self, claims_dir: str, worker_id: str, snapshots: FileSnapshotStore | None = None
    ) -> None:
        self.claims_dir = claims_dir
        self.worker_id = worker_id
        self.snapshots = snapshots
        self._content = worker_id.encode()

    def _path(self, session_id: str) -> str:
        return os.path.join(self.claims_dir, claim_name(session_id))

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        with _overloaded_on_exhaustion():
            return self.create_now(session_id)

    async def read(self, session_id: str) -> str | None:
        with _overloaded_on_exhaustion():
            return self.read_now(session_id)

    async def remove(self, session_id: str) -> None:
        # The snapshot first: a snapshot never outlives its claim, even when
        # this worker dies between the two unlinks.
        if self.snapshots is not None:
            self.snapshots.remove(session_id)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(session_id))

    async def hold(self, session_id: str) -> bool:
        return True

    async def expire(self, session_id: str, seconds: float) -> bool:
        return True

    async def holder_exited(self, worker_id: str) -> bool:
        """Its process is gone; a worker that refuses but still runs is waited for, briefly.

        A live worker's socket refuses only once it has stopped its private
        listener on its way out (drained, reloaded, stopped alone): it serves
        nothing more and exits moments later, so wait for that rather than
        answer 410. A pid that stays (reused by another process) is never gone.
        """
        if worker_id == self.worker_id:
            return False
        deadline = time.monotonic() + _EXIT_WAIT_SECONDS
        while worker_process_exists(worker_id):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        with _overloaded_on_exhaustion():
            outcome = self.take_over_now(session_id, dead_holder)
            deadline = time.monotonic() + _TAKEOVER_WAIT_SECONDS
            # Another worker holds the takeover lock: its claim lands within
            # microseconds; forward to it then rather than answer 410.
            while outcome == dead_holder and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                outcome = self.read_now(session_id)
            return outcome

    def take_over_now(self, session_id: str, dead_holder: str) -> str | None:
        """`take_over` without a coroutine and without waiting for another taker.

        The protocol (docs/design.md §3.14.3): a lock file
        ``.takeover-<claim name>-<hash of dead holder>`` created with
        ``O_EXCL`` admits one taker per (claim, dead holder); under it the taker
        compares the claim's content with ``dead_holder`` and only then
        replaces the claim with its own (temporary file, ``os.replace``:
        readers see the old holder or the new one, whole). The dead holder
        never writes again, so a content of ``dead_holder`` seen under the
        lock cannot be a newer claim; a taker that saw it before another's
        replace finds the new holder once it has the lock. A taker killed
        while holding the lock leaves it: that session then answers 410 as
        without durability (the safe side: never two holders).
        """
        path = self._path(session_id)
        current = self.read_now(session_id)
        if current != dead_holder:
            return current
        holder_hash = hashlib.sha256(dead_holder.encode()).hexdigest()[:16]
        name = os.path.basename(path)
        lock = os.path.join(self.claims_dir, f".takeover-{name}-{holder_hash}")
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return dead_holder  # another worker is taking it over right now
        try:
            try:
                os.write(fd, self._content)
            finally:
                os.close(fd)
            current = self.read_now(session_id)
            if current != dead_holder:
                return current  # taken over (and maybe released) before we had the lock
            tmp = os.path.join(self.claims_dir, f".tmp-{self.worker_id}-{secrets.token_hex(8)}")
            tmp_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(tmp_fd, self._content)
            finally:
                os.close(tmp_fd)
            os.replace(tmp, path)
            return None
        finally:
            os.unlink(lock)

    def create_now(self, session_id: str) -> str | None:
        """`create` without a coroutine (benchmarks, tests)."""
        path = self._path(session_id)
        tmp = os.path.join(self.claims_dir, f".tmp-{self.worker_id}-{secrets.token_hex(8)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, self._content)
        finally:
            os.close(fd)
        try:
            # A claim removed between our failed link and our read is gone for
            # good, so a few tries settle every race.
            for _ in range(8):
                try:
                    os.link(tmp, path)
                    return None
                except FileExistsError:
                    holder = self.read_now(session_id)
                    if holder is not None:
                        return holder
            raise RuntimeError(f"could not settle the claim of session {session_id!r}")
        finally:
            os.unlink(tmp)

    def read_now(self, session_id: str) -> str | None:
        """`read` without a coroutine (benchmarks, tests)."""
        # os.open/os.read: a third of the cost of a buffered file object.
        try:
            fd = os.open(self._path(session_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, 256).decode() or None
        finally:
            os.close(fd)


class LocalClaimStore:
    """The store of a server with one worker (or routing off): every claim is local."""

    expires = False

    async def create(self, session_id: str, *, restoring: bool = False) -> str | None:
        return None

    async def read(self, session_id: str) -> str | None:
        return None

    async def remove(self, session_id: str) -> None:
        return None

    async def hold(self, session_id: str) -> bool:
        return True

    async def expire(self, session_id: str, seconds: float) -> bool:
        return True

    async def take_over(self, session_id: str, dead_holder: str) -> str | None:
        return None  # one worker: nobody else could hold it

    async def holder_exited(self, worker_id: str) -> bool:
        return False  # one worker never sees another's claim
