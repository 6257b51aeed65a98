"""Where a session's request is served, seen from one worker: one rule for router and batches.

A request (or a step batch's entry) that names an existing session goes
through the same three questions on every path (docs/design.md §3.4.1 steps
4-6, §3.4.7):

1. **Who holds it?** (`OwnedClaims.holder`, or the holder `claim` returns.)
   Held here or by nobody: serve here (the handler or the entry's own checks
   answer for an id nobody holds). Held by another worker: send it there,
   unless this request may not move again (it came over a private socket, its
   connection was just handed here for it, or this worker does not route), and
   then it is a lost race: 409. (A handed-over step batch still sends its
   entries on over the hop: only the connection may not move twice.)
2. **The holder refused the hop.** Only then can nothing have run there, so
   only then may a durable session be taken over (its process must also have
   exited: a slow worker is never taken over; `SessionSnapshots.may_take_over`).
3. **After a takeover** (`SessionSnapshots.take_over`): the winner serves it,
   which is this worker or another one (sent there, never taken over twice);
   no winner means there was no snapshot to restore: 410, as without
   durable sessions.

`SessionRouter` and `StepBatchRoute` differ only in what they do with each
answer (a reply of their own or one entry's result), never in the answers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gym_sessions.errors import HTTPError, SessionConflictError
from gym_sessions.routing.forwarder import HolderRefusedError
from gym_sessions.routing.session_snapshots import SessionSnapshots

__all__ = [
    "Destination",
    "Serve",
    "after_takeover",
    "held_elsewhere",
    "may_take_over_after",
    "of_holder",
]


class Serve(enum.Enum):
    """Who serves a session's request."""

    #: This worker: it holds the session, or nobody does.
    HERE = "here"
    #: `Destination.worker`, over the hop (or by handing the connection over).
    THERE = "there"
    #: Nobody: the session is held by `Destination.worker` and this request may
    #: not move again (409), or its holder is gone with nothing to restore (410).
    NOBODY = "nobody"


@dataclass(frozen=True, slots=True)
class Destination:
    """Where one request for a session goes from this worker, and which worker that names."""

    serve: Serve
    #: The holder (``THERE``, or ``NOBODY`` after a lost race), the gone
    #: holder (``NOBODY`` after a takeover found nothing), else ``None``.
    worker: str | None = None


_HERE = Destination(Serve.HERE)


def of_holder(holder: str | None, worker_id: str, *, may_forward: bool) -> Destination:
    """Where a request goes whose session ``holder`` holds (``None``: nobody does).

    ``may_forward``: a public request on a worker that routes. One that already
    moved (over the hop, or with its connection) meets another holder only by
    losing a race.
    """
    if holder is None or holder == worker_id:
        return _HERE
    if may_forward:
        return Destination(Serve.THERE, holder)
    return Destination(Serve.NOBODY, holder)


def held_elsewhere(session_id: str, holder: str | None) -> SessionConflictError:
    """The 409 of a request (`Serve.NOBODY`) whose session another worker holds.

    It can only have been claimed there while the request was on its way to
    this worker: a request that may move never gets this answer.
    """
    return SessionConflictError(
        f"session {session_id!r} is held by another worker ({holder}): it was claimed there"
        " while this request was on its way"
    )


async def may_take_over_after(
    error: HTTPError, holder: str, snapshots: SessionSnapshots | None, *, restorable: bool = True
) -> bool:
    """Whether a hop to ``holder`` that failed with ``error`` lets its durable session be restored.

    Only a refused connection (the request never ran there), only with durable
    sessions, only when ``restorable`` (not a takeover's winner, whose death is
    a plain 410), and only once the holder's process has exited.
    """
    return (
        restorable
        and snapshots is not None
        and isinstance(error, HolderRefusedError)
        and await snapshots.may_take_over(holder)
    )


async def after_takeover(
    snapshots: SessionSnapshots, session_id: str, dead_holder: str, worker_id: str
) -> Destination:
    """Where ``session_id``'s request goes once ``dead_holder``'s claim on it is contested.

    Of the workers racing to restore it one wins: ``HERE`` when it is this
    worker (restored here), ``THERE`` the winner (not to be taken over again),
    ``NOBODY`` (410, ``worker`` the gone holder) when there was nothing to
    restore. Raises what the claim store raises when it cannot tell (503).
    """
    winner = await snapshots.take_over(session_id, dead_holder)
    if winner == worker_id:
        return _HERE
    if winner is None:
        return Destination(Serve.NOBODY, dead_holder)
    return Destination(Serve.THERE, winner)
