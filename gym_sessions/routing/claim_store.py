"""Where claims live: which worker holds which session.

`FileClaimStore` keeps one file per claimed session under the runtime
directory's ``claims/``. The name is a hash of the session id (never a path
built from it); the content is the claimant's worker id. A claim is created by
hard-linking a complete temporary file into place: the link fails if the claim
exists, so two workers never both hold an id, and a reader never sees half a
claim. `LocalClaimStore` is the one-worker store: it writes nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from typing import Protocol

__all__ = ["ClaimStore", "FileClaimStore", "LocalClaimStore", "claim_file_name"]


class ClaimStore(Protocol):
    """Shared record of which worker claims which session."""

    def create(self, session_id: str) -> str | None:
        """Claim ``session_id`` for this worker.

        Returns ``None`` when the claim was created, else the worker id of the
        worker that already holds it.
        """

    def read(self, session_id: str) -> str | None:
        """The worker id that claims ``session_id``, or ``None``."""

    def remove(self, session_id: str) -> None:
        """Remove this worker's claim of ``session_id``."""


def claim_file_name(session_id: str) -> str:
    """The file name of a session's claim: a hash, so no id can name a path."""
    return hashlib.sha256(session_id.encode()).hexdigest()


class FileClaimStore:
    """Claims as files in a directory shared by the workers of one server."""

    def __init__(self, claims_dir: str, worker_id: str) -> None:
        self.claims_dir = claims_dir
        self.worker_id = worker_id
        self._content = worker_id.encode()

    def _path(self, session_id: str) -> str:
        return os.path.join(self.claims_dir, claim_file_name(session_id))

    def create(self, session_id: str) -> str | None:
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
                    owner = self.read(session_id)
                    if owner is not None:
                        return owner
            raise RuntimeError(f"could not settle the claim of session {session_id!r}")
        finally:
            os.unlink(tmp)

    def read(self, session_id: str) -> str | None:
        # os.open/os.read: a third of the cost of a buffered file object.
        try:
            fd = os.open(self._path(session_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            return os.read(fd, 256).decode() or None
        finally:
            os.close(fd)

    def remove(self, session_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(session_id))


class LocalClaimStore:
    """The store of a server with one worker (or routing off): every claim is local."""

    def create(self, session_id: str) -> str | None:
        return None

    def read(self, session_id: str) -> str | None:
        return None

    def remove(self, session_id: str) -> None:
        return None
