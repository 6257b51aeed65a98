"""``POST /step_batch``: many sessions' steps in one request, each entry checked as a ``/step``.

A batch names no session of its own: the router hands it here before it looks
for a session id (`SessionRouter` with ``step_batch=``). Each entry carries
its session's credential (the session cookie's value) and an action::

    {"entries": [{"cookie": "<gym_session cookie value>", "action": 1}, ...]}

and gets its own result, in entry order, in one 200 reply::

    {"results": [{"observation": ..., "reward": ..., "terminated": ..., "truncated": ...,
                  "info": {...}, "worker": "w1"},
                 {"status": 409, "error": {"code": "session_conflict", "message": ...},
                  "worker": "w0"}, ...]}

The routing rule, per entry (docs/design.md §3.4.7):

1. the cookie names the session exactly as for ``/step`` (`read_credentials`
   rules: a tampered or expired cookie names nothing, a session token is
   refused with 403 because tokens reach MCP tool calls only);
2. the entry is served by the session's holder: entries held here are served
   here, one after another; on a public request, entries held by other
   workers are sent to each holder as one sub-batch over the private hop
   (concurrently), and their results merged back; a request that came over a
   private socket is never forwarded again (an entry held elsewhere there is
   409, as a private ``/step`` would be); when every entry of a public batch
   is held by one other worker, the connection itself is first offered to it
   (`Handoff`, one host), so the client's next batches land on the holder;
   with durable sessions, a holder that
   refused the hop and has exited is taken over entry by entry, as each
   entry's ``/step`` would take it over (`SessionSnapshots.take_over`);
3. on the holder, an entry is admitted by the ownership rule (`SessionAccess`)
   against the session's incarnation, after `OwnedClaims.enter`, as a single
   ``/step`` is; a refused entry changes nothing and the others still step;
4. an entry whose session nobody holds is never run: 409 ``session_closed`` /
   410 ``session_expired`` if this worker recorded its close, else 404
   ``no_open_episode`` (what a lone ``/step`` answers; no provisional claim).

Whole-batch errors: a body over ``max_body_bytes`` is 413 (the router reads the
body with the same bound as any request), more than `MAX_BATCH_ENTRIES`
entries 413, a body that is not ``{"entries": [...]}`` of objects with a
string ``cookie`` and an ``action`` 400, a session named twice 400. ``worker``
is the holder's worker id (no secret): clients group entries by it.

Body and reply may each be a binary message instead (``Content-Type`` and
``Accept``, `gym_sessions.value_messages`): the same objects, with each
entry's action and each result's observation a segment. A sub-batch goes to
its holder in the body's encoding, with the request's ``Accept``, and its
results (values already encoded) are merged as they come.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Message, Scope, Send

from gym_sessions import strict_json
from gym_sessions.credentials import SessionCredentials
from gym_sessions.errors import (
    BodyTooLargeError,
    HTTPError,
    InternalServerError,
    InvalidBinaryError,
    InvalidJSONError,
    InvalidRequestError,
    MethodNotAllowedError,
    NoOpenEpisodeError,
    SessionGoneError,
    error_from_body,
    unexpected_error,
)
from gym_sessions.routing.destination import (
    Destination,
    Serve,
    after_takeover,
    held_elsewhere,
    may_take_over_after,
    of_holder,
)
from gym_sessions.routing.forwarder import Forwarder, holder_gone, hop_error
from gym_sessions.routing.handoff import Handoff
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.request_session import RequestSession
from gym_sessions.routing.session_access import SessionAccess
from gym_sessions.routing.session_ids import (
    IdSource,
    SessionIdSources,
    find_session_id,
    route_path,
)
from gym_sessions.routing.session_snapshots import SessionSnapshots
from gym_sessions.scope_keys import HANDED_IN_SCOPE_KEY
from gym_sessions.value_messages import (
    BATCH_BODY,
    BATCH_REPLY,
    BINARY_MEDIA_TYPE,
    Encoding,
    SpaceValue,
    body_encoding,
    body_encoding_of,
    decode_message,
    encode_message,
    reply_encoding_of,
)

__all__ = [
    "MAX_BATCH_ENTRIES",
    "STEP_BATCH_PATH",
    "BatchSteps",
    "StepBatchRoute",
    "is_step_batch",
]

logger = logging.getLogger("gym_sessions.routing")

STEP_BATCH_PATH = "/step_batch"
#: Entries one batch may carry (413 beyond), on top of the body's byte bound.
MAX_BATCH_ENTRIES = 1024
#: The route a batch entry stands for: it names its session as a ``/step`` does.
_ENTRY_PATH = "/step"


class BatchSteps(Protocol):
    """What a server that offers batches does for one entry (`GymEnvServer` implements it)."""

    async def step_session(
        self, session_id: str, action: Any, at_length: int | None = None
    ) -> dict[str, Any]:
        """Step ``session_id`` (held and admitted here) as ``/step`` would; its reply fields.

        ``at_length``: the entry's ``episode_length``, as ``/step``'s ``x-gym-episode-length``.
        """

    def refuse_if_closed(self, session_id: str) -> None:
        """Raise the error a tool call of a closed ``session_id`` gets (409/410)."""


def is_step_batch(scope: Scope) -> bool:
    """Whether the request is for the batch route (any method, with or without rollout prefix)."""
    return route_path(scope["path"]) == STEP_BATCH_PATH


@dataclass
class _Entry:
    index: int
    raw: dict[str, Any]
    session_id: str | None = None
    cookie: dict[str, Any] | None = None
    result: dict[str, Any] | None = None


_BINARY_CONTENT_TYPE = BINARY_MEDIA_TYPE.encode()


def _encoded(result: dict[str, Any], encoding: Encoding) -> dict[str, Any]:
    """A served entry's result with its observation encoded for the reply."""
    observation = result.get("observation")
    if isinstance(observation, SpaceValue):
        result["observation"] = (
            observation.to_json() if encoding is Encoding.JSON else observation.to_binary()
        )
    return result


def _error_result(error: HTTPError, worker: str | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "status": error.status,
        "error": {"code": error.code, "message": error.message},
    }
    if worker is not None:
        result["worker"] = worker
    return result


def _parse(body: bytes, encoding: Encoding) -> list[dict[str, Any]]:
    """The batch's entries; raises for a body that is not a well-formed batch.

    From a binary message, each entry's ``action`` is its `BinaryValue`.
    """
    if encoding is Encoding.BINARY:
        data: Any = decode_message(body, BATCH_BODY)
    else:
        try:
            data = strict_json.loads(body) if body.strip() else None
        except ValueError as exc:
            raise InvalidJSONError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict) or set(data) != {"entries"}:
        raise InvalidRequestError('a step batch is a JSON object {"entries": [...]}')
    entries = data["entries"]
    if not isinstance(entries, list) or not entries:
        raise InvalidRequestError("entries must be a non-empty array")
    if len(entries) > MAX_BATCH_ENTRIES:
        raise BodyTooLargeError(
            f"a step batch carries at most {MAX_BATCH_ENTRIES} entries, not {len(entries)}"
        )
    for i, entry in enumerate(entries):
        if (
            not isinstance(entry, dict)
            or set(entry) - {"episode_length"} != {"cookie", "action"}
            or not isinstance(entry["cookie"], str)
            or not entry["cookie"]
        ):
            raise InvalidRequestError(
                f'entries[{i}] must be an object {{"cookie": "<session cookie>", "action": ...}}'
                ' (and "episode_length": n, optional)'
            )
        length = entry.get("episode_length")
        if length is not None and (type(length) is not int or length < 0):
            raise InvalidRequestError(
                f"entries[{i}].episode_length must be the episode's length, a non-negative integer"
            )
    return entries


class StepBatchRoute:
    """Serves ``POST /step_batch`` for the router of one worker (see the module).

    Args:
        steps: The server's per-entry step.
        sources: Where the server finds session ids (the cookie's key).
        credentials: Verifies the entries' cookies.
        claims: This worker's claims.
        access: The ownership rule (the router's own).
        forwarder: The hop to other workers; ``None`` with one worker.
        snapshots: Durable sessions, if on: an entry's snapshot is written
            before the batch replies, as a ``/step``'s before its reply.
        record_step: Records an entry's handler time (operator metrics), if on.
        handoff: Hand the connection itself to the holder when every entry of
            a public batch is another worker's, all the same one's
            (`Handoff.hand_over`, as the router does for a ``/step``); ``None``:
            the sub-batch hops.
    """

    def __init__(
        self,
        steps: BatchSteps,
        *,
        sources: SessionIdSources,
        credentials: SessionCredentials,
        claims: OwnedClaims,
        access: SessionAccess,
        forwarder: Forwarder | None,
        snapshots: SessionSnapshots | None = None,
        record_step: Callable[[float], None] | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self.steps = steps
        self.sources = sources
        self.credentials = credentials
        self.claims = claims
        self.access = access
        self.forwarder = forwarder
        self.snapshots = snapshots
        self.record_step = record_step
        self.handoff = handoff

    async def serve(
        self,
        scope: Scope,
        body: bytes,
        send: Send,
        *,
        private: bool,
        send_error: Callable[[Send, HTTPError], Awaitable[None]],
    ) -> None:
        """Answer one batch request (its body already read within the router's bounds)."""
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowedError(f"{STEP_BATCH_PATH} takes POST only")
            entries = [
                _Entry(i, raw) for i, raw in enumerate(_parse(body, body_encoding_of(scope)))
            ]
            self._name_sessions(entries)
        except HTTPError as error:
            await send_error(send, error)
            return
        encoding = reply_encoding_of(scope)
        if await self._serve_entries(entries, scope, body, private, encoding):
            return  # the holder took the connection: it answers
        results = {"results": [entry.result for entry in entries]}
        if encoding is Encoding.BINARY:
            reply = encode_message(results, BATCH_REPLY)
            content_type = _BINARY_CONTENT_TYPE
        else:
            reply = json.dumps(results).encode()
            content_type = b"application/json"
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(reply))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": reply})

    def _name_sessions(self, entries: list[_Entry]) -> None:
        """Find each entry's session as ``/step`` would; a session named twice is 400."""
        seen: dict[str, int] = {}
        for entry in entries:
            cookie = self.credentials.decode_cookie(entry.raw["cookie"])
            try:
                found = find_session_id(self.sources, _ENTRY_PATH, cookie, None, None)
            except HTTPError as error:  # pragma: no cover - no token, no body: never raises
                entry.result = _error_result(error, None)
                continue
            if found is None:
                # What a /step with this cookie meets: a minted id with no episode.
                entry.result = _error_result(
                    NoOpenEpisodeError(
                        "this entry's cookie is not a valid session cookie of this server: "
                        "it names no session; call /reset"
                    ),
                    None,
                )
                continue
            first = seen.setdefault(found.session_id, entry.index)
            if first != entry.index:
                raise InvalidRequestError(
                    f"entries[{first}] and entries[{entry.index}] name the same session; "
                    "a batch steps each session once"
                )
            entry.session_id, entry.cookie = found.session_id, cookie

    async def _serve_entries(
        self, entries: list[_Entry], scope: Scope, body: bytes, private: bool, encoding: Encoding
    ) -> bool:
        """Serve or send on every entry; ``True``: the connection went to the one holder."""
        here: list[_Entry] = []
        elsewhere: dict[str, list[_Entry]] = {}
        may_forward = not private and self.forwarder is not None
        for entry in entries:
            if entry.session_id is None:
                continue
            destination = of_holder(
                await self._holder(entry), self.claims.worker_id, may_forward=may_forward
            )
            if destination.serve is Serve.HERE:
                here.append(entry)
            elif destination.serve is Serve.THERE:
                assert destination.worker is not None
                elsewhere.setdefault(destination.worker, []).append(entry)
            else:
                entry.result = _error_result(
                    held_elsewhere(entry.session_id, destination.worker), destination.worker
                )
        if (
            self.handoff is not None
            and not here
            and len(elsewhere) == 1
            and scope.get(HANDED_IN_SCOPE_KEY) is None  # moved once for this request already
        ):
            # One holder for the whole batch: its next batches land right too.
            ((holder, group),) = elsewhere.items()
            assert group[0].session_id is not None
            if await self.handoff.hand_over(holder, group[0].session_id, scope, body):
                return True
        forwards = [
            asyncio.ensure_future(self._forward(holder, group, scope))
            for holder, group in elsewhere.items()
        ]
        try:
            for entry in here:
                entry.result = await self._serve_here(entry, encoding)
        finally:
            if forwards:
                await asyncio.gather(*forwards)
        return False

    async def _holder(self, entry: _Entry) -> str | None:
        assert entry.session_id is not None
        try:
            return await self.claims.holder(entry.session_id)
        except HTTPError as error:  # the claim store cannot tell (503)
            entry.result = _error_result(error, None)
            return None

    async def _serve_here(self, entry: _Entry, encoding: Encoding) -> dict[str, Any]:
        if entry.result is not None:
            return entry.result
        sid = entry.session_id
        assert sid is not None
        worker = self.claims.worker_id
        claims = self.claims
        try:
            if sid not in claims:
                # Nobody holds it: never run a handler under an unclaimed id.
                self.steps.refuse_if_closed(sid)
                raise NoOpenEpisodeError("this session has no open episode: call /reset first")
            await claims.enter(sid)
            try:
                routed = RequestSession(
                    sid, IdSource.COOKIE, False, self.sources.claims_on_use, entry.cookie
                )
                self.access.admit(routed, claims.incarnation(sid))
                started = time.perf_counter()
                try:
                    result = _encoded(
                        await self.steps.step_session(
                            sid, entry.raw["action"], entry.raw.get("episode_length")
                        ),
                        encoding,
                    )
                finally:
                    if self.record_step is not None:
                        self.record_step(time.perf_counter() - started)
                    if self.snapshots is not None:
                        await self.snapshots.after_request(sid, held=True)
            finally:
                await claims.leave(sid)
        except HTTPError as error:
            return _error_result(error, worker)
        except Exception as exc:  # an entry's failure is its own, never the batch's
            logger.exception("step batch entry of session %r failed", sid)
            return _error_result(unexpected_error(exc), worker)
        result["worker"] = worker
        return result

    async def _forward(
        self, holder: str, group: list[_Entry], scope: Scope, *, restorable: bool = True
    ) -> None:
        """One sub-batch to ``holder`` over the private hop; its results go to ``group``.

        A holder that refused the hop and has exited is taken over, entry by
        entry, as each entry's own ``/step`` would take it over (``restorable``:
        not for a takeover's winner, whose death is a 410).
        """
        assert self.forwarder is not None
        sub_batch = {"entries": [entry.raw for entry in group]}
        if body_encoding_of(scope) is Encoding.BINARY:
            sub_body = encode_message(sub_batch, BATCH_BODY)
        else:
            sub_body = json.dumps(sub_batch).encode()
        status = 0
        reply_type: bytes | None = None
        chunks: list[bytes] = []

        async def capture(message: Message) -> None:
            nonlocal status, reply_type
            if message["type"] == "http.response.start":
                status = message["status"]
                reply_type = next(
                    (v for k, v in message.get("headers", ()) if k.lower() == b"content-type"),
                    None,
                )
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        try:
            try:
                await self.forwarder.forward(holder, scope, sub_body, capture)
            except HTTPError as error:  # the hop's own failure, not the holder's reply
                reported = hop_error(error, holder, durable=self.snapshots is not None)
                if reported is error:
                    raise
                raise reported from error
            reply = b"".join(chunks)
            if status != 200:
                raise error_from_body(status, reply)
            if body_encoding(reply_type) is Encoding.BINARY:
                try:
                    results = decode_message(reply, BATCH_REPLY)["results"]
                except InvalidBinaryError as exc:  # the holder's fault, not the client's
                    raise ValueError(exc.message) from exc
            else:
                results = json.loads(reply)["results"]
            if len(results) != len(group):
                raise InternalServerError(f"worker {holder} answered a sub-batch of another size")
        except HTTPError as error:
            if await may_take_over_after(error, holder, self.snapshots, restorable=restorable):
                await self._take_over(holder, group, scope)
                return
            if isinstance(error, SessionGoneError):
                error = holder_gone(holder)
            for entry in group:
                entry.result = _error_result(error, holder)
            return
        except (ValueError, KeyError, TypeError) as exc:
            for entry in group:
                entry.result = _error_result(
                    InternalServerError(f"worker {holder} sent a bad sub-batch reply: {exc}"),
                    holder,
                )
            return
        for entry, result in zip(group, results, strict=True):
            entry.result = result

    async def _take_over(self, dead_holder: str, group: list[_Entry], scope: Scope) -> None:
        """Restore ``group``'s durable sessions from ``dead_holder``, which is gone, and step them.

        Each entry's session goes where `SessionSnapshots.take_over` says, as
        its ``/step`` would: served here once restored, sent on to the worker
        that won its takeover, or 410 when it cannot be restored.
        """
        assert self.snapshots is not None
        snapshots = self.snapshots

        async def destination_of(entry: _Entry) -> Destination | None:
            assert entry.session_id is not None
            try:
                return await after_takeover(
                    snapshots, entry.session_id, dead_holder, self.claims.worker_id
                )
            except HTTPError as error:  # the claim store cannot tell (503)
                entry.result = _error_result(error, None)
                return None

        destinations = await asyncio.gather(*(destination_of(entry) for entry in group))
        here: list[_Entry] = []
        winners: dict[str, list[_Entry]] = {}
        for entry, destination in zip(group, destinations, strict=True):
            if destination is None:
                continue
            if destination.serve is Serve.HERE:
                here.append(entry)
            elif destination.serve is Serve.THERE:
                assert destination.worker is not None
                winners.setdefault(destination.worker, []).append(entry)
            else:
                entry.result = _error_result(holder_gone(dead_holder), dead_holder)

        encoding = reply_encoding_of(scope)

        async def serve_here() -> None:
            for entry in here:
                entry.result = await self._serve_here(entry, encoding)

        await asyncio.gather(
            serve_here(),
            *(self._forward(w, entries, scope, restorable=False) for w, entries in winners.items()),
        )
