"""Where claims live: which worker holds which session.

A `ClaimStore` is shared by every worker of a deployment. Two implementations:

- `FileClaimStore` (``claims = "file"``, one host): one file per claimed
  session under the runtime directory's ``claims/``. The name is a hash of the
  session id (never a path built from it); the content is the holder's
  worker id. A claim is created by hard-linking a complete temporary file into
  place: the link fails if the claim exists, so two workers never both hold an
  id, and a reader never sees half a claim. Files end with the server.
- `RedisClaimStore` (``claims = "redis://..."``, several hosts; in
  `gym_sessions.routing.redis_claims`): one key per claim, created with
  ``SET NX``; a claim that is not open expires by itself.

`LocalClaimStore` is the one-worker store: it writes nothing.

The methods are coroutines so a networked store never blocks the event loop;
the file store does its (local, microsecond) work synchronously inside them.
A store that cannot answer raises `ClaimsUnavailableError` (503).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from typing import Protocol

from gym_sessions.errors import OverloadedError, out_of_resources

__all__ = ["ClaimStore", "FileClaimStore", "LocalClaimStore", "claim_name"]


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


def claim_name(session_id: str) -> str:
    """A claim's name in a store: a hash, so no id can name a path or a key pattern."""
    return hashlib.sha256(session_id.encode()).hexdigest()


class FileClaimStore:
    """Claims as files in a directory shared by the workers of one server."""

    expires = False

    def __init__(self, claims_dir: str, worker_id: str) -> None:
        self.claims_dir = claims_dir
        self.worker_id = worker_id
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
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(session_id))

    async def hold(self, session_id: str) -> bool:
        return True

    async def expire(self, session_id: str, seconds: float) -> bool:
        return True

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
