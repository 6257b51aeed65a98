"""A step whose reply was lost: ask ``/observe`` whether it ran, then resend it or say so. No I/O.

``/step`` is not idempotent, so its reply lost to a broken connection is never
resent blindly (`Request.resendable` is false for it). `StepRecovery` decides
instead, from the episode length the client counted before the step::

    POST /step ── reply ─────────────────────────────────────────────▶ the reply
      │ ConnectionLostError, or 502 bad_gateway (a hop behind the server broke)
      ▼
    POST /observe ── episode_length unchanged: the step did not run ──▶ POST /step again
      │ episode_length moved on, or 404 no_open_episode:                 (its reply, or
      ▼ the step ran (and may have ended the episode)                     its error as is)
    ConnectionLostError "the step ran on the server but its reply was lost"

"Did not run" can be out of date by the time the resend arrives: the first
send may still be on its way (held in a hop whose accepting worker died, say)
and run after the ``/observe``. Every step therefore carries the episode length
it was sent at (`step_request`), and the server runs it only at that length;
a resend refused with 409 ``step_out_of_order`` means the first send ran after
all, and is reported as above.

A 502 is the server's own "connection lost": the worker that took the
request passed it to the session's holder, which died before answering (with
durable sessions the next request restores the session there). Any other
error is raised as it comes: an error reply, a timeout (the step may still be
running, so asking now would not tell) and a failed ``/observe``.

The shells drive it (`HTTPClient.send_step`, `AsyncHTTPClient.send_step`): send
`StepRecovery.request` and report the reply or error until it is ``None``.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable

from gym_sessions.client.exchange import Reply, Request
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    GymSessionsError,
    NoOpenEpisodeError,
    StepOutOfOrderError,
)

__all__ = ["OBSERVE_REQUEST", "StepRecovery", "step_ran"]

#: The episode's latest observation and length; changes nothing, so resendable.
OBSERVE_REQUEST = Request("POST", "/observe", {}, resendable=True)


class _Stage(enum.Enum):
    STEP = "step"  # the step is out
    OBSERVE = "observe"  # its reply was lost: is the episode where it was?
    RESEND = "resend"  # it did not run: sent once more
    DONE = "done"


def step_ran(lost: GymSessionsError) -> ConnectionLostError:
    """The error for a step that ran on the server but whose reply (``lost``) was lost."""
    error = ConnectionLostError(
        lost.url if isinstance(lost, ConnectionLostError) else "the server",
        "POST /step",
        f"the step ran on the server but its reply was lost ({lost}); call reset()",
    )
    error.__cause__ = lost
    return error


class StepRecovery:
    """The requests of one step, its lost reply included (see the module).

    Args:
        step: The ``/step`` request.
        episode_length: Steps the episode has taken before this one, as the
            server counts them.
        on_ran: Called once it is known that the step ran though its reply was
            lost, before that is raised: the caller's count of the episode's
            steps moves on (its next step is sent at the length the server has).
    """

    def __init__(
        self, step: Request, episode_length: int, on_ran: Callable[[], None] | None = None
    ) -> None:
        self.step = step
        self.episode_length = episode_length
        self.on_ran = on_ran
        #: What to send next; ``None`` once the step's reply is in.
        self.request: Request | None = step
        self._stage = _Stage.STEP
        self._lost: GymSessionsError | None = None
        self._reply: Reply | None = None

    @property
    def reply(self) -> Reply:
        """The step's reply, once `request` is ``None``."""
        assert self._reply is not None, "send StepRecovery.request until it is None"
        return self._reply

    def replied(self, reply: Reply) -> None:
        """Take the reply to `request`; raises if it shows the lost step ran."""
        if self._stage is _Stage.OBSERVE:
            if reply.json()["episode_length"] != self.episode_length:
                raise self._ran()
            self._stage, self.request = _Stage.RESEND, self.step
            return
        self._stage, self.request, self._reply = _Stage.DONE, None, reply

    def failed(self, error: GymSessionsError) -> None:
        """Take the error `request` got; returns if there is a request to send next, else raises."""
        if self._stage is _Stage.STEP and isinstance(error, (ConnectionLostError, BadGatewayError)):
            self._lost = error
            self._stage, self.request = _Stage.OBSERVE, OBSERVE_REQUEST
            return
        if self._stage is _Stage.OBSERVE and isinstance(error, NoOpenEpisodeError):
            raise self._ran() from error  # the step ran and ended the episode
        if self._stage is _Stage.RESEND and isinstance(error, StepOutOfOrderError):
            raise self._ran() from error  # the first send ran after the /observe
        raise error

    def drive(self, send: Callable[[Request], Reply]) -> Reply:
        """Send `request` with ``send`` until the reply is in; the reply (or the error raised)."""
        while self.request is not None:
            try:
                reply = send(self.request)
            except GymSessionsError as error:
                self.failed(error)  # returns only if there is a request to send next
            else:
                self.replied(reply)
        return self.reply

    async def drive_async(self, send: Callable[[Request], Awaitable[Reply]]) -> Reply:
        """`drive` with an async ``send``."""
        while self.request is not None:
            try:
                reply = await send(self.request)
            except GymSessionsError as error:
                self.failed(error)
            else:
                self.replied(reply)
        return self.reply

    def _ran(self) -> ConnectionLostError:
        assert self._lost is not None  # only a lost step reply leads here
        if self.on_ran is not None:
            self.on_ran()
        return step_ran(self._lost)
