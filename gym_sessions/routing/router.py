"""The routing rule: every request of a session is served by the worker that claims it.

For each HTTP request `SessionRouter`:

1. reads the body (bounded by ``max_body_bytes``) and finds the session id
   (`find_session_id`), minting a random one when the request names none;
2. if another worker claims that id, forwards the request to it over its
   private socket and streams the reply back (410 if that worker is gone,
   unless the session is durable: then it is restored here, `SessionSnapshots`);
3. otherwise serves it here, once the ownership rule (`SessionAccess`) has
   admitted it. Every request that names an id is claimed before its handler
   runs: a session start or a close naming an id always, and a cookie naming
   an id nobody holds provisionally (the claim ends with the request unless
   the handler used the session on a server whose sessions start on use). On
   such a server (resources servers, not agents) a request with a minted id
   claims it when the reply starts, if its handler used the session and the
   reply is no error. If another worker claimed the id meanwhile, the reply is 409.

A client that disconnects before its reply starts cancels the forward or the
handler (`DisconnectWatch`), except on routes that run to completion (starts,
closes, ``/verify``).

A request that arrived over a private socket is always served here (over a
private TCP listener, only with a valid forward signature: `ForwardSigner`). With one
worker (or routing off) the same steps run against a store that writes
nothing, so ids, cookies, conflicts and lifetimes behave the same.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gym_sessions import strict_json
from gym_sessions.credentials import SessionCredentials
from gym_sessions.error_reply import send_error
from gym_sessions.errors import (
    BodyTooLargeError,
    CapacityReachedError,
    HeadersTooLargeError,
    HTTPError,
    RequestTimeoutError,
    SessionConflictError,
    SessionGoneError,
    unexpected_error,
)
from gym_sessions.routing.body_budget import BodyBudget, BodyTicket, body_cost
from gym_sessions.routing.destination import (
    Serve,
    after_takeover,
    held_elsewhere,
    may_take_over_after,
    of_holder,
)
from gym_sessions.routing.disconnect import DisconnectWatch
from gym_sessions.routing.forward_signature import ForwardSigner
from gym_sessions.routing.forwarder import Forwarder, HolderRefusedError, holder_gone, hop_error
from gym_sessions.routing.handoff import Handoff, HandoffCounts
from gym_sessions.routing.hop_headers import (
    HELD_MARK,
    HOP_MARKS_KEY,
    NOT_HELD_HEADER,
    PLACED_MARK,
    received_mark,
)
from gym_sessions.routing.incarnations import Incarnation
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.placement import PLACEMENT_ROUNDS, Placement, refuses_placed
from gym_sessions.routing.request_session import (
    REQUEST_SESSION_KEY,
    RequestSession,
    claims_on_reply,
)
from gym_sessions.routing.session_access import SessionAccess
from gym_sessions.routing.session_cookie import SessionCookie
from gym_sessions.routing.session_ids import (
    IdSource,
    SessionIdSources,
    find_session_id,
    find_session_key,
    is_valid_session_id,
    read_credentials,
    route_path,
)
from gym_sessions.routing.session_snapshots import SessionSnapshots
from gym_sessions.routing.step_batch import StepBatchRoute, is_step_batch
from gym_sessions.routing.worker_hints import holder_hint, relayed_by_hint
from gym_sessions.scope_keys import (
    HANDED_IN_SCOPE_KEY,
    PRIVATE_SCOPE_KEY,
    SERVED_SCOPE_KEY,
    STARTS_HERE_SCOPE_KEY,
    Served,
)
from gym_sessions.wire import DEBUG_WORKER_HEADER, START_BESIDE_HEADER

__all__ = [
    "FORWARDED_BY_HEADER",
    "HANDED_OVER_BY_HEADER",
    "NO_ROOM_HEADER",
    "WORKER_HEADER",
    "SessionRouter",
]

logger = logging.getLogger("gym_sessions.routing")

WORKER_HEADER = DEBUG_WORKER_HEADER.encode()
FORWARDED_BY_HEADER = b"x-gym-forwarded-by"
#: With the debug header, on the reply to a request whose connection was handed here.
HANDED_OVER_BY_HEADER = b"x-gym-handed-over-by"
#: On a private hop's 503: this worker is full, ask another (never reaches a client).
NO_ROOM_HEADER = b"x-gym-no-room"


_START_BESIDE = START_BESIDE_HEADER.encode()


class _ClientDisconnected(Exception):
    pass


def _read_head(scope: Scope, limit: int) -> int | None:
    """One pass over the request's headers: 431 past ``limit``; the declared body length."""
    size = 0
    declared = None
    for name, value in scope["headers"]:
        size += len(name) + len(value) + 4
        if name == b"content-length" and value.isdigit():
            declared = int(value)
    if size > limit:
        raise HeadersTooLargeError(f"request headers add up to more than {limit} bytes")
    return declared


async def _receive_within(
    receive: Receive, stall_seconds: float, task: asyncio.Task[Any] | None = None
) -> Message:
    """``await receive()``, or 408 once it waited ``stall_seconds``.

    As ``asyncio.timeout`` would, but the timer is armed on the loop's next
    turn, which comes only if the ``receive`` suspends: uvicorn hands a body
    that has arrived without suspending (most requests), and then no timer
    (nor a ``Timeout`` object, about half the cost of reading a small body)
    is made at all. The bound starts a turn later, not measurably.
    """
    if task is None:  # the running one; the router passes its own (one lookup per request)
        task = asyncio.current_task()
        assert task is not None
    loop = task.get_loop()
    timer: asyncio.TimerHandle | None = None
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    def arm() -> None:
        nonlocal timer
        timer = loop.call_later(stall_seconds, expire)

    arming = loop.call_soon(arm)
    try:
        return await receive()
    except asyncio.CancelledError:
        # `uncancel` takes back our cancellation; more left means someone else's too.
        if expired and task.uncancel() == 0:
            raise RequestTimeoutError(
                f"the request body stalled for more than {stall_seconds:g} s"
            ) from None
        raise
    finally:
        arming.cancel()
        if timer is not None:
            timer.cancel()


async def _read_body(
    receive: Receive,
    declared: int | None,
    limit: int,
    stall_seconds: float,
    ticket: BodyTicket,
    task: asyncio.Task[Any],
) -> bytes:
    if declared is not None and declared > limit:
        raise BodyTooLargeError(f"request body is larger than {limit} bytes")
    if declared:
        await ticket.take(declared)  # room first: a body that cannot fit is never read
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await _receive_within(receive, stall_seconds, task)
        if message["type"] == "http.disconnect":
            raise _ClientDisconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(f"request body is larger than {limit} bytes")
            if size > ticket.size:  # chunked, or more than declared
                await ticket.take(size - ticket.size)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class SessionRouter:
    """Pure ASGI middleware applying the routing rule, around the worker's routes.

    A request served here gets ``request.session`` and its reply's session
    cookie from `SessionCookie`.

    Args:
        app: The worker's app (its routes).
        sources: Where this kind of server finds session ids.
        credentials: Verifies cookies and tokens.
        claims: This worker's claims.
        forwarder: The hop to other workers; ``None`` with one worker.
        start_paths: Paths that start a session (claimed before the handler).
        close_paths: Paths that close a session (claimed before the handler
            when they name an id, so a delayed start reaches the worker that
            recorded the close).
        jsonrpc_paths: Paths whose errors are JSON-RPC error objects (MCP).
        max_body_bytes: Larger bodies get 413.
        max_header_bytes: Larger header sections get 431.
        body_read_timeout_seconds: A body stalled longer than this gets 408.
        debug_worker_header: Add ``x-gym-worker: <worker id>`` to every reply
            this worker's app produced, and ``x-gym-forwarded-by: <worker id>``
            to every reply this worker forwarded (for benchmarks and debugging).
        forward_signer: Set when private listeners are on TCP (Redis claims):
            a request arriving privately is served only with a valid signature.
        trust_session_ids: A typed start or close naming a session by id alone
            reaches it (see `SessionAccess`).
        worker_ids: Lists every worker a full worker may hand a session start
            to (``--max-sessions``).
        body_budget: Memory request bodies may take on this worker at once,
            their parse included (``--max-inflight-body-bytes``).
        runs_to_completion: Paths whose handler is not cancelled when its client
            disconnects (they change a session's lifetime); every other
            handler, and every forward, is.
        snapshots: Durable sessions (``--durable-sessions``): snapshots are
            written before replies, and a dead holder's sessions restored here.
        handoff: Hand a request's connection to its holder before hopping
            (``--handoff on``, one host); ``None``: always hop.
        placement: Balanced placement (``--placement balanced``): a new
            session's start goes to the worker with the fewest sessions
            (`Placement`); ``None``: it starts where it arrived.
        step_batch: Serves ``/step_batch``, which names no session of its own:
            each entry is routed to its holder (`gym_sessions.routing.step_batch`).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        sources: SessionIdSources,
        credentials: SessionCredentials,
        claims: OwnedClaims,
        forwarder: Forwarder | None,
        start_paths: Collection[str],
        close_paths: Collection[str],
        max_body_bytes: int,
        max_header_bytes: int = 64 * 1024,
        body_read_timeout_seconds: float = 60.0,
        jsonrpc_paths: Collection[str] = (),
        debug_worker_header: bool = False,
        forward_signer: ForwardSigner | None = None,
        trust_session_ids: bool = False,
        worker_ids: Callable[[], Awaitable[list[str]]] | None = None,
        body_budget: BodyBudget | None = None,
        runs_to_completion: Collection[str] = (),
        snapshots: SessionSnapshots | None = None,
        handoff: Handoff | None = None,
        placement: Placement | None = None,
        step_batch: StepBatchRoute | None = None,
    ) -> None:
        self.app = app
        self.handoff = handoff
        self.placement = placement
        #: Requests sent on to a holder: handed over or hopped (``/health``).
        self.deliveries = handoff.counts if handoff is not None else HandoffCounts()
        self.runs_to_completion = frozenset(runs_to_completion)
        self.snapshots = snapshots
        self.step_batch = step_batch
        self.body_budget = body_budget or BodyBudget(max(max_body_bytes, 1) * 4)
        self.worker_ids = worker_ids or _no_workers
        # Requests other workers forwarded here: a worker shutting down waits for them.
        self.private_in_flight = 0
        self.private_done_at = 0.0
        self.access = SessionAccess(credentials, trust_session_ids)
        self.session_cookie = SessionCookie(credentials, sources.cookie_key, claims)
        self.sources = sources
        self.credentials = credentials
        self.claims = claims
        self.forwarder = forwarder
        self.start_paths = frozenset(start_paths)
        self.close_paths = frozenset(close_paths)
        self.jsonrpc_paths = frozenset(jsonrpc_paths)
        self.worker_header = (
            (WORKER_HEADER, claims.worker_id.encode()) if debug_worker_header else None
        )
        # A pooling client's hint of where each session lives (`worker_hints`), whenever
        # sessions are routed: unrouted workers hold nothing another could reach.
        self.holder_hint = holder_hint(claims.worker_id) if forwarder is not None else None
        self.relayed_by_hint = relayed_by_hint(claims.worker_id)
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.body_read_timeout_seconds = body_read_timeout_seconds
        self.forward_signer = forward_signer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ticket = self.body_budget.ticket()
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        private = scope.get(PRIVATE_SCOPE_KEY, False)
        if private:
            self.private_in_flight += 1
        try:
            await self._handle(scope, receive, send_tracked, ticket)
        except Exception as exc:
            if started:
                raise  # uvicorn closes the connection of a reply it cannot finish
            # Never uvicorn's plain-text 500: a JSON error, the worker carries on.
            logger.exception("unexpected failure routing %s %s", scope["method"], scope["path"])
            await self._send_error(scope, send, unexpected_error(exc))
        finally:
            ticket.release()
            if private:
                self.private_in_flight -= 1
                self.private_done_at = time.monotonic()

    async def _handle(self, scope: Scope, receive: Receive, send: Send, ticket: BodyTicket) -> None:
        private = scope.get(PRIVATE_SCOPE_KEY, False)
        # Looked up once: each lookup of the running loop or task is a getpid() call.
        task = asyncio.current_task()
        assert task is not None
        try:
            declared = _read_head(scope, self.max_header_bytes)
            signed_digest = None
            if private and self.forward_signer is not None:
                # Before the body: an unsigned request costs the listener no body.
                signed_digest = self.forward_signer.verify_head(scope, self.claims.worker_id)
            body = await _read_body(
                receive, declared, self.max_body_bytes, self.body_read_timeout_seconds, ticket, task
            )
            # Before anything parses it, the memory its parse may take (413 or 503 if it cannot).
            await ticket.cover(body_cost(body))
            if signed_digest is not None:
                assert self.forward_signer is not None  # the head was checked by it
                self.forward_signer.verify_body(signed_digest, body)
            if self.step_batch is not None and is_step_batch(scope):
                # Names no session itself: each entry goes to its own holder.
                await self.step_batch.serve(
                    scope, body, send, private=private, send_error=send_error
                )
                return
            routed = self._find_session(scope, body)
        except _ClientDisconnected:
            return
        except HTTPError as error:
            await self._send_error(scope, send, error)
            return
        scope[REQUEST_SESSION_KEY] = routed
        watch = DisconnectWatch(receive, task)
        try:
            await self._route(routed, private, scope, body, watch, send)
        finally:
            watch.close()
            if routed.room is not None:
                self.claims.give_back_room(routed.room)
            # uvicorn keeps the scope while the connection idles: drop the parsed
            # body and session with the request, or an idle keep-alive connection
            # would hold them outside the body budget.
            scope.pop(REQUEST_SESSION_KEY, None)
            scope.pop("session", None)
            routed.json_body = None
            routed.body = None
            routed.data = None

    async def _route(
        self,
        routed: RequestSession,
        private: bool,
        scope: Scope,
        body: bytes,
        watch: DisconnectWatch,
        send: Send,
    ) -> None:
        sid = routed.session_id
        handed_by = scope.get(HANDED_IN_SCOPE_KEY)
        if handed_by is not None:
            # Served here, as a hop's arrival is: its connection already moved once for it.
            scope[SERVED_SCOPE_KEY] = Served.HANDED_OVER
            if self.worker_header is not None:
                send = _with_header(send, (HANDED_OVER_BY_HEADER, str(handed_by).encode()))
        try:
            if not private and handed_by is None and self.forwarder is not None:
                if routed.claims_first:
                    if routed.starts and await self._placed_elsewhere(
                        routed, scope, body, watch, send
                    ):
                        return
                    if routed.starts and not self._take_room(routed):
                        await self._start_elsewhere(routed, scope, body, watch, send)
                        return
                    # One store call: claiming answers who holds the id if not us.
                    holder = await self.claims.claim(sid)
                    self.claims.forget_holder(sid)  # a close (or restart) may move or end it
                elif routed.source is IdSource.MINTED:
                    # Nobody can hold an id minted just now: no store lookup (health
                    # checks and /spaces never wait on, or fail with, the store).
                    holder = None
                else:
                    cached = self.claims.cached_holder(sid)
                    if cached is not None and await self._forward_cached(
                        cached, routed, scope, body, watch, send
                    ):
                        return
                    holder = await self.claims.holder(sid)
                    if holder is None and routed.source is IdSource.COOKIE:
                        holder = await self._claim_provisionally(routed)
                destination = of_holder(holder, self.claims.worker_id, may_forward=True)
                if destination.serve is Serve.THERE:
                    assert destination.worker is not None
                    forwarded = await self._forward(
                        destination.worker,
                        scope,
                        body,
                        watch,
                        send,
                        start=routed.starts,
                        restorable=True,
                    )
                    if forwarded:
                        return
                    # The holder refused and has exited: restore its session here.
                    if not await self._restore(
                        routed, destination.worker, scope, body, watch, send
                    ):
                        return
            elif (
                private
                and routed.starts
                and refuses_placed(self.claims, received_mark(scope, PLACED_MARK))
            ):
                raise _no_room()  # the sender saw this worker emptier: it asks another
            elif private and sid not in self.claims and received_mark(scope, HELD_MARK):
                raise _NotHeldError(f"worker {self.claims.worker_id} does not hold {sid!r}")
            else:
                other = await self._claim_here(routed)
                destination = of_holder(other, self.claims.worker_id, may_forward=False)
                if destination.serve is Serve.NOBODY:
                    if private and received_mark(scope, PLACED_MARK) is not None:
                        # A copy of this start (a retry, say) was placed on another
                        # worker meanwhile: refuse privately, the sender routes it there.
                        raise _no_room()
                    raise held_elsewhere(sid, destination.worker)
        except HTTPError as error:
            if private and isinstance(error, CapacityReachedError):
                send = _with_header(send, (NO_ROOM_HEADER, b"1"))
            elif private and isinstance(error, _NotHeldError):
                send = _with_header(send, (NOT_HELD_HEADER, b"1"))
            await self._send_error(scope, send, error)
            return
        await self._serve_here(routed, scope, body, watch, send)

    async def _forward_cached(
        self,
        holder: str,
        routed: RequestSession,
        scope: Scope,
        body: bytes,
        watch: DisconnectWatch,
        send: Send,
    ) -> bool:
        """Forward to the holder a cached lookup names; ``False``: look it up afresh instead.

        The hop carries `HELD_MARK`, so a worker that no longer holds the
        session (closed, released, moved) refuses with `NOT_HELD_HEADER`
        instead of claiming or serving it; that reply never reaches the client.
        ``False`` too when the holder refused the connection and may have
        exited (nothing ran: a durable session may be restored, as afresh).
        """
        refused = False

        async def send_unless_refused(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                refused = any(name == NOT_HELD_HEADER for name, _ in headers)
                if refused or message["status"] in (410, 502):  # 502: it may have died
                    self.claims.forget_holder(routed.session_id)
            if not refused:
                await send(message)

        scope[HOP_MARKS_KEY] = [(HELD_MARK, b"1")]
        try:
            forwarded = await self._forward(
                holder, scope, body, watch, send_unless_refused, restorable=True
            )
        finally:
            del scope[HOP_MARKS_KEY]
        if not forwarded:
            self.claims.forget_holder(routed.session_id)
        return forwarded and (not refused or watch.cancelled)

    def _take_room(self, routed: RequestSession) -> bool:
        """Reserve room for a session start here (`OwnedClaims.reserve_room`); False if full."""
        routed.room = self.claims.reserve_room(routed.session_id)
        return routed.room is not None

    async def _start_elsewhere(
        self, routed: RequestSession, scope: Scope, body: bytes, watch: DisconnectWatch, send: Send
    ) -> None:
        """This worker is full: hand the start to the session's holder or a worker with room.

        Each other worker is asked in turn; one that is full too answers with
        `NO_ROOM_HEADER`, which never reaches the client. 503 only when every
        worker is full. With balanced placement the load board's order comes
        first (fewest sessions, counting the starts this worker is handing
        there, among those that take sessions; no balance mark: only a full or
        draining worker refuses), then the other workers, whose records may
        be stale; else a random order, so full workers do not all hand to the
        same one.
        """
        sid = routed.session_id
        if routed.source is not IdSource.MINTED:
            holder = await self.claims.holder(sid)
            if holder == self.claims.worker_id:
                raise _no_room()  # our own claim (not live): its start needs room here
            if holder is not None:
                await self._forward(holder, scope, body, watch, send, start=True)
                return
        candidates = [w for w in await self.worker_ids() if w != self.claims.worker_id]
        random.shuffle(candidates)
        placement = self.placement
        if placement is None:
            for candidate in candidates:
                if await self._offer_start(candidate, scope, body, watch, send):
                    return
            raise _no_room()
        ranked = [worker for worker, _ in await placement.targets()]
        for candidate in ranked + [w for w in candidates if w not in ranked]:
            with placement.sending(candidate):
                if await self._offer_start(candidate, scope, body, watch, send):
                    return
        raise _no_room()

    async def _placed_elsewhere(
        self, routed: RequestSession, scope: Scope, body: bytes, watch: DisconnectWatch, send: Send
    ) -> bool:
        """Balanced placement: deliver a new session's start to a less loaded worker.

        Only for an id nobody claims (minted, or unclaimed in the store). The
        worker `Placement` ranks first is offered the start; one that is full,
        draining, gone or busier than the sender saw refuses (nothing reaches
        the client), and the next round ranks afresh. ``False``: none took it,
        start it here (or, full here, as `_start_elsewhere` does).
        """
        placement = self.placement
        sid = routed.session_id
        if placement is None or sid in self.claims or scope.get(STARTS_HERE_SCOPE_KEY, False):
            return False  # (a WebSocket's start begins where its messages arrive)
        if routed.source is not IdSource.MINTED and await self.claims.holder(sid) is not None:
            return False  # an existing claim decides where this start goes
        refused: set[str] = set()
        beside = await self._holder_to_start_beside(scope)
        if beside == self.claims.worker_id:
            return False
        if beside is not None:
            # Asked for by the client, with a cookie only it has: no balance mark
            # (the target refuses only when full or draining, then it is placed).
            refused.add(beside)
            with placement.sending(beside):
                if await self._offer_start(beside, scope, body, watch, send):
                    return True
        # After a refusal the loads are read again (the refusing worker's has
        # just changed): a few rounds, one offer each, then this worker.
        for _ in range(PLACEMENT_ROUNDS):
            ranked = [t for t in await placement.targets() if t[0] not in refused]
            if not ranked:
                return False
            target, believed = ranked[0]
            refused.add(target)
            scope[HOP_MARKS_KEY] = [(PLACED_MARK, str(believed).encode())]
            try:
                with placement.sending(target):
                    if await self._offer_start(target, scope, body, watch, send):
                        return True
            finally:
                del scope[HOP_MARKS_KEY]
            if routed.source is not IdSource.MINTED and await self.claims.holder(sid) is not None:
                return False  # claimed meanwhile (a copy of this start): it goes there
        return False

    async def _holder_to_start_beside(self, scope: Scope) -> str | None:
        """The holder of the session a start's `START_BESIDE_HEADER` cookie names, if any.

        Only a valid cookie counts (a client can ask to start beside its own
        sessions, never steer by an id alone); it is advice: a worker that is
        full or draining refuses, and the start is placed as any other.
        """
        value = next((v for n, v in scope["headers"] if n == _START_BESIDE), None)
        if value is None:
            return None
        data = self.credentials.decode_cookie(value.decode("latin-1"))
        session_id = data.get(self.sources.cookie_key) if data is not None else None
        if not isinstance(session_id, str) or not is_valid_session_id(session_id):
            return None
        try:
            return await self.claims.holder(session_id)
        except HTTPError:
            return None  # the store is unavailable: place it as any other start

    async def _offer_start(
        self, worker_id: str, scope: Scope, body: bytes, watch: DisconnectWatch, send: Send
    ) -> bool:
        """Forward a start to ``worker_id``; False if it had no room (nothing was sent)."""
        assert self.forwarder is not None
        refused = False
        # Reached only by a reply the client gets.
        send = _marking_forwarded(scope, send, self.relayed_by_hint)

        async def send_unless_refused(message: Message) -> None:
            nonlocal refused
            if message["type"] == "http.response.start" and any(
                name == NO_ROOM_HEADER for name, _ in message.get("headers", [])
            ):
                refused = True
            if not refused:
                await send(message)

        target: Send = send_unless_refused
        if self.worker_header is not None:
            target = _with_header(target, (FORWARDED_BY_HEADER, self.worker_header[1]))
        try:
            forward = self.forwarder.forward(worker_id, scope, body, watch.watching(target))
            await watch.run(forward, cancellable=True)
        except SessionGoneError:
            return False  # a worker that exited has no room either
        return not refused or watch.cancelled

    async def _claim_here(self, routed: RequestSession) -> str | None:
        """With nobody to forward to: claim what the request names; the other holder or None.

        Raises:
            CapacityReachedError: a session start and this worker is full.
        """
        if routed.claims_first:
            if routed.starts and not self._take_room(routed):
                raise _no_room()
            return await self.claims.claim(routed.session_id)
        if routed.source is IdSource.COOKIE and routed.session_id not in self.claims:
            return await self._claim_provisionally(routed)
        return None

    async def _claim_provisionally(self, routed: RequestSession) -> str | None:
        """Claim the unclaimed id a cookie names before its handler runs.

        Then the ownership rule sees the id's incarnation before any handler
        touches state under that id: a cookie of an ended incarnation can never
        run a handler beside a new session that claims the id meanwhile.
        """
        other = await self.claims.claim(routed.session_id)
        routed.provisional = other is None
        return other

    async def _send_error(self, scope: Scope, send: Send, error: HTTPError) -> None:
        jsonrpc = route_path(scope["path"]) in self.jsonrpc_paths
        await send_error(send, error, jsonrpc=jsonrpc)

    def _find_session(self, scope: Scope, body: bytes) -> RequestSession:
        path = route_path(scope["path"])
        cookie, token = read_credentials(scope["headers"], self.credentials)
        json_body = None
        typed = scope["method"] == "POST" and path in self.sources.typed_paths
        if typed:
            try:
                json_body = strict_json.loads(body) if body.strip() else None
            except ValueError:
                json_body = None  # the handler reports invalid JSON
        found = find_session_id(self.sources, path, cookie, token, json_body)
        session_key = find_session_key(self.sources, path, json_body)
        if found is None:
            sid, source = uuid.uuid4().hex, IdSource.MINTED
        else:
            sid, source = found.session_id, found.source
        starts = scope["method"] == "POST" and path in self.start_paths
        claims_first = starts or (
            scope["method"] == "POST" and path in self.close_paths and source is not IdSource.MINTED
        )
        routed = RequestSession(
            sid,
            source,
            claims_first,
            self.sources.claims_on_use,
            cookie,
            token=token,
            session_key=session_key,
            starts=starts,
        )
        if typed and json_body is not None:
            routed.json_body = json_body
        return routed

    async def _forward(
        self,
        holder: str,
        scope: Scope,
        body: bytes,
        watch: DisconnectWatch,
        send: Send,
        *,
        start: bool = False,
        restorable: bool = False,
    ) -> bool:
        """Forward to ``holder``; ``False`` (nothing sent) when a durable session may be restored.

        That is: durable sessions are on, ``restorable``, the holder refused
        the connection (so the request never ran there) and its process has
        exited (a live but slow worker is never taken over).
        """
        assert self.forwarder is not None
        if self.handoff is not None:
            session_id = scope[REQUEST_SESSION_KEY].session_id
            if await self.handoff.hand_over(holder, session_id, scope, body):
                return True
        else:
            self.deliveries.hop(None)
        reply_send = send
        if start:
            # The holder may be full (it holds a closed session's claim): its
            # private no-room mark is for workers, never for the client.
            reply_send = _without_header(reply_send, NO_ROOM_HEADER)
        if self.worker_header is not None:
            reply_send = _with_header(reply_send, (FORWARDED_BY_HEADER, self.worker_header[1]))
        try:
            # Always cancellable: cancelling the hop closes its connection, and the
            # holder decides for its handler as it would for a client of its own.
            marked = _marking_forwarded(scope, reply_send, self.relayed_by_hint)
            forward = self.forwarder.forward(holder, scope, body, watch.watching(marked))
            await watch.run(forward, cancellable=True)
        except HolderRefusedError as error:
            if await may_take_over_after(error, holder, self.snapshots, restorable=restorable):
                return False
            await self._send_error(scope, reply_send, error)
        except HTTPError as error:
            error = hop_error(error, holder, durable=self.snapshots is not None)
            await self._send_error(scope, reply_send, error)
        return True

    async def _restore(
        self,
        routed: RequestSession,
        dead_holder: str,
        scope: Scope,
        body: bytes,
        watch: DisconnectWatch,
        send: Send,
    ) -> bool:
        """Take a dead holder's durable session over; ``True``: serve the request here.

        Of the workers racing to restore it, one wins (`SessionSnapshots.take_over`);
        the others forward to the winner. Without a snapshot the request gets
        410 as without durable sessions.
        """
        assert self.snapshots is not None
        destination = await after_takeover(
            self.snapshots, routed.session_id, dead_holder, self.claims.worker_id
        )
        if destination.serve is Serve.HERE:
            return True
        assert destination.worker is not None
        if destination.serve is Serve.THERE:
            # Not restorable: a winner that died too is a 410.
            await self._forward(destination.worker, scope, body, watch, send, start=routed.starts)
        else:
            await self._send_error(scope, send, holder_gone(destination.worker))
        return False

    async def _serve_here(
        self,
        routed: RequestSession,
        scope: Scope,
        body: bytes,
        watch: DisconnectWatch,
        send: Send,
    ) -> None:
        sid = routed.session_id
        claims = self.claims
        held = sid in claims
        try:
            if held:
                await claims.enter(sid)
                try:
                    self.access.admit(routed, claims.incarnation(sid))
                except HTTPError:
                    await claims.leave(sid)
                    raise
            else:
                self.access.admit(routed, None)
        except HTTPError as error:
            await self._send_error(scope, send, error)
            return
        refused = False
        body_sent = False

        async def replay_body() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await watch.receive()

        async def send_claimed(message: Message) -> None:
            nonlocal held, refused
            if refused:
                return
            if message["type"] == "http.response.start":
                watch.reply_started()  # folded in: one wrapper less per message
                # Decided before this reply's claim, as the handler left the session.
                cookie = self.session_cookie.header(routed, message["status"])
                if not held and claims_on_reply(routed, message["status"]):
                    # A minted id whose handler used it: its incarnation is the nonce
                    # the reply's cookie already carries.
                    incarnation = Incarnation(nonce=routed.incarnation or "", bound=True)
                    try:
                        if await claims.claim(sid, incarnation) is not None:
                            raise _claimed_elsewhere(sid)
                        if claims.incarnation(sid) is not incarnation:
                            raise _claimed_elsewhere(sid)
                        await claims.enter(sid)
                    except HTTPError as error:
                        refused = True
                        claims.drop_unclaimed_state(sid)
                        await self._send_error(scope, send, error)
                        return
                    held = True
                if self.snapshots is not None:
                    # Before the reply leaves: what the client sees is what a restore gives.
                    await self.snapshots.after_request(sid, held=held)
                # Only a reply about a session this worker holds names it as the holder
                # (not /health or /spaces: a session-less request holds nothing).
                hint = self.holder_hint if held else None
                extra = [h for h in (cookie, hint, self.worker_header) if h]
                if extra:
                    message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        routed.body = body  # for `read_json`: the body is not read twice
        self.session_cookie.attach(scope, routed)
        cancellable = route_path(scope["path"]) not in self.runs_to_completion
        try:
            # ASGI apps are coroutine functions: the watch may close one it never awaits.
            handler = cast(
                "Coroutine[Any, Any, None]",
                self.app(scope, replay_body, send_claimed),
            )
            await watch.run(handler, cancellable=cancellable)
        finally:
            if routed.room is not None:
                # A start that did not open its session frees its room now, before
                # the store round trip in `leave`: the client has its reply and may
                # start again at once.
                claims.give_back_room(routed.room)
            if held:
                if routed.provisional and not (routed.claims_on_use and routed.used):
                    claims.release_now(sid)  # claimed for this request only, and unused
                await claims.leave(sid)


def _marking_forwarded(scope: Scope, send: Send, relayed_by: tuple[bytes, bytes]) -> Send:
    """``send`` for a reply from another worker: noted in ``scope`` (`Served`), and
    ``relayed_by`` added (the client's connection stays here, `worker_hints`)."""

    async def send_forwarded(message: Message) -> None:
        if message["type"] == "http.response.start":
            scope[SERVED_SCOPE_KEY] = Served.FORWARDED
            message["headers"] = [*message.get("headers", []), relayed_by]
        await send(message)

    return send_forwarded


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    async def send_with_header(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), header]
        await send(message)

    return send_with_header


def _without_header(send: Send, name: bytes) -> Send:
    async def send_without_header(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [h for h in message.get("headers", []) if h[0] != name]
        await send(message)

    return send_without_header


async def _no_workers() -> list[str]:
    return []


class _NotHeldError(SessionConflictError):
    """A hop with `HELD_MARK` reached a worker that does not hold its session (private only)."""


def _no_room() -> CapacityReachedError:
    return CapacityReachedError(
        "every worker holds as many live sessions as --max-sessions allows; close a session "
        "or try again later"
    )


def _claimed_elsewhere(session_id: str) -> SessionConflictError:
    return SessionConflictError(
        f"session {session_id!r} was claimed by another worker while this request was served"
    )
