"""One vector step's steps as a few ``POST /step_batch`` requests: one per holder group.

`RemoteVectorEnv` uses it when the server offers the batch route (``/spaces``
names it). Sub-envs are grouped by the worker that holds their session (the
``worker`` each entry's result names, first known from ``/health`` after the
session's reset); each group's entries go in one request over the kept-alive
connection of one of its sub-envs, which reached that worker when it started
its session, so the batch is served there without a hop (the server sends any
entry held elsewhere to its holder itself: `gym_sessions.routing.step_batch`).

Every rule of a single step holds for each entry:

- its result raises what its ``/step`` would (`error_from_body`, by code);
- each entry carries its episode length, as a ``/step`` does
  (``x-gym-episode-length``): the server runs it at that length only;
- a batch whose reply was lost (the connection broke) is not resent: each of
  its sub-envs recovers as a lost ``/step`` does (`StepRecovery`, over its own
  connection): ``/observe`` tells whether its step ran, then it is sent alone
  again or `ConnectionLostError` says it ran; so does an entry whose result is
  a 502 (its holder died with the entry sent to it), and a whole batch
  answered 502;
- a recovery that meets a 502 itself (its ``/observe``, already sent again
  once by the exchange as every resendable request is, or its step's resend,
  went over a hop to a holder that had just died; with durable sessions the
  next request restores the session) recovers once more: ``/observe`` changes
  nothing, and the episode length it reads decides as before, so no step runs
  twice;
- a timeout or another error of the whole batch is every entry's error;
- a sub-env without a session cookie yet (a reply that set none) steps alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from gym_sessions.client.async_remote_env import AsyncRemoteEnv
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    GymSessionsError,
    InternalServerError,
)

__all__ = ["StepBatch"]

StepResult = tuple[Any, float, bool, bool, dict[str, Any]]


class StepBatch:
    """The steps of ``actions`` (sub-env index to action), sent together by `run`.

    Args:
        envs: Every sub-env of the vector env.
        actions: The action of each sub-env that steps now.
        path: The server's batch route.
        max_entries: The most entries the server takes in one batch.
    """

    def __init__(
        self,
        envs: Sequence[AsyncRemoteEnv],
        actions: Mapping[int, Any],
        path: str,
        max_entries: int,
    ) -> None:
        self.envs = envs
        self.actions = dict(actions)
        self.path = path
        self.max_entries = max_entries

    async def run(self) -> dict[int, StepResult | BaseException]:
        """Send the batches; each sub-env's step result, or the error its step raised."""
        results: dict[int, StepResult | BaseException] = {}
        groups: dict[str | None, list[tuple[int, dict[str, Any]]]] = {}
        alone: list[int] = []
        for i, action in self.actions.items():
            entry = self.envs[i].batch_entry(action)
            if entry is None:
                alone.append(i)
            else:
                groups.setdefault(self.envs[i].worker, []).append((i, entry))
        size = self.max_entries
        chunks = [
            group[k : k + size] for group in groups.values() for k in range(0, len(group), size)
        ]

        async def step_alone(i: int) -> None:
            try:
                results[i] = await self.envs[i].step(self.actions[i])
            except GymSessionsError as error:
                results[i] = error

        if len(chunks) == 1 and not alone:
            await self._send(chunks[0], results)  # one request: no task of its own
        else:
            await asyncio.gather(
                *(self._send(chunk, results) for chunk in chunks), *(step_alone(i) for i in alone)
            )
        return results

    async def _send(
        self,
        chunk: list[tuple[int, dict[str, Any]]],
        results: dict[int, StepResult | BaseException],
    ) -> None:
        leader = self.envs[chunk[0][0]]
        try:
            replies = await leader.send_batch(self.path, [entry for _, entry in chunk])
            if len(replies) != len(chunk):
                raise InternalServerError(
                    f"the server answered a batch of {len(chunk)} with {len(replies)} results"
                )
        except (ConnectionLostError, BadGatewayError) as lost:
            await asyncio.gather(*(self._recover(i, lost, results) for i, _ in chunk))
            return
        except GymSessionsError as error:
            for i, _ in chunk:
                results[i] = error
            return
        recover: list[tuple[int, BadGatewayError]] = []
        for (i, _), reply in zip(chunk, replies, strict=True):
            try:
                results[i] = self.envs[i].batch_result(reply)
            except BadGatewayError as broken:  # its holder died with the entry sent: may have run
                recover.append((i, broken))
            except GymSessionsError as error:
                results[i] = error
        await asyncio.gather(*(self._recover(i, broken, results) for i, broken in recover))

    async def _recover(
        self,
        i: int,
        lost: ConnectionLostError | BadGatewayError,
        results: dict[int, StepResult | BaseException],
    ) -> None:
        try:
            try:
                results[i] = await self.envs[i].recover_lost_step(self.actions[i], lost)
            except BadGatewayError:
                results[i] = await self.envs[i].recover_lost_step(self.actions[i], lost)
        except GymSessionsError as error:
            results[i] = error
