"""The resources-server base: sessions, their starts, verification and closes.

A resources server keeps per-session state in the worker that created it.
Subclasses implement the hooks (`start_session`, `verify_session`,
`release_session`) and declare their tools with `tools`; the base owns the
lifetime rules: a successful start opens the session, a close or a verify
without ``x-gym-close-follows`` ends it, a closed id is refused a new start for
the window, and state is released once, on close or when the claim ends.

``/seed_session`` is idempotent for its holder (whoever the ownership rule
admits: cookie, ``session_key`` or, with ``--trust-session-ids``, the id): a
seed of an open session whose body equals that of the start that opened the
current episode gets that start's reply again and changes nothing; any other
body is 409 ``session_conflict``. ``/reset`` (any other start route) always
starts a new episode. Requests carrying NeMo Gym's ``episode_id`` get NeMo's
reply shapes (`gym_sessions.server.episodes`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gym_sessions.credentials import SessionCredentials
from gym_sessions.errors import (
    EnvError,
    InvalidRequestError,
    SessionClosedError,
    SessionConflictError,
    SessionExpiredError,
)
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.request_session import request_session
from gym_sessions.routing.session_ids import (
    RESOURCES_SOURCES,
    SESSION_KEY_FIELD,
    IdSource,
    SessionIdSources,
    route_path,
)
from gym_sessions.routing.step_batch import BatchSteps
from gym_sessions.server.base import SessionServer
from gym_sessions.server.bodies import BodySchema, Field, read_json
from gym_sessions.server.closed_sessions import ClosedResourcesSessionRecords
from gym_sessions.server.episodes import CLOSE_FIELDS, SEED_FIELDS, EpisodeBinding, episode_of
from gym_sessions.server.mcp import MCP_PATH, SESSION_TOKEN_HEADER_NAME, McpEndpoint
from gym_sessions.server.replies import value_response
from gym_sessions.server.session_locks import SessionLocks
from gym_sessions.server.tools import Tool, ToolHandler
from gym_sessions.settings import Settings
from gym_sessions.value_messages import VALUE_REPLY, reply_encoding_of
from gym_sessions.wire import CLOSE_FOLLOWS_HEADER

__all__ = ["CLOSE_FOLLOWS_HEADER", "SEED_PATH", "ResourcesServer", "session_id"]

#: The start route that never restarts an open session (NeMo Gym's seed).
SEED_PATH = "/seed_session"

SEED_BODY = BodySchema(
    {
        "resources_session_id": Field(("string", "null"), description="client-chosen session id"),
        "seed": Field(("integer", "null"), description="RNG seed, 0 <= seed < 2**64"),
        "options": Field(("object", "null"), description="reset options"),
        SESSION_KEY_FIELD: Field(
            ("string", "null"), description="the client's proof for later starts and closes"
        ),
        "mcp_tools": Field(
            ("array", "null"), description="the tools this session's MCP token may list and call"
        ),
        **SEED_FIELDS,
    },
    allow_extra=True,
)
CLOSE_BODY = BodySchema(
    {
        "resources_session_id": Field(("string", "null")),
        SESSION_KEY_FIELD: Field(("string", "null")),
        **CLOSE_FIELDS,
    }
)
ANY_BODY = BodySchema(allow_extra=True)
AGGREGATE_BODY = BodySchema({"verify_responses": Field(("array",), required=True)})


@dataclass(frozen=True)
class _StartRecord:
    """The start that opened a session's current episode: what it asked and what it got."""

    body: dict[str, Any]  # without the session key and the id
    reply: dict[str, Any]


def _start_fields(body: dict[str, Any]) -> dict[str, Any]:
    """What makes two starts of one id the same start: the body, less credential and id."""
    fields = {k: v for k, v in body.items() if k != RESOURCES_SOURCES.body_key}
    return copy.deepcopy(fields)  # a hook may change the body it is given


def session_id(request: Request) -> str:
    """The request's resources session id; reading it counts as using the session."""
    return request.session[RESOURCES_SOURCES.cookie_key]


class ResourcesServer(SessionServer):
    """Base class of servers that keep state per session."""

    sources: ClassVar[SessionIdSources] = RESOURCES_SOURCES
    close_paths: ClassVar[tuple[str, ...]] = ("/close_session",)
    jsonrpc_paths: ClassVar[tuple[str, ...]] = (MCP_PATH,)

    closed: ClosedResourcesSessionRecords

    def _attach(
        self, settings: Settings, claims: OwnedClaims, credentials: SessionCredentials
    ) -> None:
        super()._attach(settings, claims, credentials)
        self.closed = ClosedResourcesSessionRecords(settings.session_close_retry_window_seconds)
        self.episodes = EpisodeBinding()
        self._starts: dict[str, _StartRecord] = {}
        #: Closed sessions whose release raised: the next close tries again.
        self._unreleased: set[str] = set()
        self._start_locks = SessionLocks()
        claims.on_release(self._claim_ended)
        claims.on_idle(self._expire_idle)

    @property
    def start_paths(self) -> tuple[str, ...]:
        return self.settings.checkpoint_session_starts

    @property
    def runs_to_completion_paths(self) -> tuple[str, ...]:
        # A verify may end the session: it finishes, as closes do.
        return (*super().runs_to_completion_paths, "/verify")

    # Hooks -------------------------------------------------------------------------------

    async def start_session(self, session_id: str, body: dict[str, Any], path: str) -> dict:
        """Start (or restart) ``session_id`` from a start route's body; returns reply fields.

        An ``observation`` field that is a `SpaceValue` travels in the encoding
        the request asked for (JSON by default, binary on request).
        """
        return {}

    async def verify_session(self, session_id: str, body: dict[str, Any]) -> dict:
        """Score the session; the reply must hold at least ``reward``."""
        return {"reward": 0.0}

    def release_session(self, session_id: str) -> None:
        """Drop the session's state. Called once per state; must tolerate unknown ids."""

    def tools(self) -> list[Tool]:
        """The server's tools: each is an HTTP route and an MCP tool."""
        return []

    def extra_routes(self) -> list[BaseRoute]:
        """Routes a subclass adds beside the tools (``/spaces``, say)."""
        return []

    def batch_steps(self) -> BatchSteps | None:
        """What serves ``/step_batch`` entries; ``None``: the server offers no batches."""
        return None

    # Routes ------------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        """Every route of the server, without the rollout prefix."""
        tools = [
            replace(tool, handler=self._refusing_closed(tool.name, tool.handler))
            for tool in self.tools()
        ]
        starts = [
            Route(path, self._start_route(path), methods=["POST"])
            for path in self.settings.checkpoint_session_starts
        ]
        return [
            *super().routes(),
            *starts,
            Route("/verify", self._verify_route, methods=["POST"]),
            Route("/close_session", self._close_route, methods=["POST"]),
            Route("/aggregate_metrics", self._aggregate_route, methods=["POST"]),
            *self.extra_routes(),
            *(tool.route() for tool in tools),
            McpEndpoint(tools, session_id, name=type(self).__name__).route(),
        ]

    def refuse_if_closed(self, sid: str) -> None:
        """Raise if ``sid`` was closed within the window: 410 if it idled out, else 409."""
        if sid in self.closed:
            if self.closed.expired(sid):
                raise SessionExpiredError(
                    f"session {sid!r} had no request for {self.settings.session_idle_timeout:g} s "
                    "and was closed; start a new session"
                )
            raise SessionClosedError(f"session {sid!r} is closed")

    def _refusing_closed(self, name: str, handler: ToolHandler) -> ToolHandler:
        async def call(request: Request, arguments: dict[str, Any]) -> dict[str, Any]:
            self.refuse_if_closed(session_id(request))
            metrics = self.operator_metrics
            if metrics is None:
                return await handler(request, arguments)
            # The handler alone (the env's step): routing and the hop are not in it.
            started = time.perf_counter()
            try:
                return await handler(request, arguments)
            finally:
                via = "mcp" if route_path(request.scope["path"]) == MCP_PATH else "http"
                metrics.tool_call(name, via, time.perf_counter() - started)

        return call

    def _start_route(self, path: str) -> Callable[[Request], Awaitable[Response]]:
        async def start(request: Request) -> Response:
            encoding = reply_encoding_of(request.scope)
            body = SEED_BODY.validate(await read_json(request))
            body.pop(SESSION_KEY_FIELD, None)  # a credential, not task data for the hook
            episode = episode_of(body)
            tools = self._mcp_tools(body.get("mcp_tools"))
            sid = session_id(request)
            # Retries of one seed (or a seed beside a reset) must not interleave
            # their hooks: the second would restart what the first made.
            async with self._start_locks.hold(sid):
                self.refuse_if_closed(sid)
                self.episodes.check(sid, episode)
                fields = _start_fields(body)
                last = self._starts.get(sid)
                if path == SEED_PATH and last is not None:
                    repeated = self._repeated_seed(sid, last, fields)
                    return value_response(repeated, encoding, VALUE_REPLY)
                try:
                    reply = await self.start_session(sid, body, path)
                except BaseException:
                    # The episode the record describes may be gone (a restart that
                    # failed half-way): a later seed starts afresh, never replays it.
                    self._starts.pop(sid, None)
                    raise
                if sid in self.closed:  # closed while the start awaited
                    self.release_session(sid)
                    raise SessionClosedError(f"session {sid!r} was closed while it started")
                self.claims.mark_open(sid)
                incarnation = request_session(request.scope).incarnation
                assert incarnation is not None  # the router admitted this start
                token = self.credentials.mint_token(sid, incarnation, tools)
                content = (
                    self._nemo_seed_reply(sid, token)
                    if episode is not None
                    else {
                        "resources_session_id": sid,
                        **reply,
                        "mcp": {
                            "url_path": MCP_PATH,
                            "headers": {SESSION_TOKEN_HEADER_NAME: token},
                        },
                    }
                )
                self._starts[sid] = _StartRecord(fields, content)
                self.episodes.bind(sid, episode)
                return value_response(content, encoding, VALUE_REPLY)

        return start

    def _repeated_seed(
        self, sid: str, last: _StartRecord, fields: dict[str, Any]
    ) -> dict[str, Any]:
        """A seed of an open session: the same start's reply again, or 409 for another body."""
        if fields != last.body:
            raise SessionConflictError(
                f"session {sid!r} is open and was started with another body; a seed never "
                "restarts a session (POST /reset starts a new episode)"
            )
        return last.reply

    def _nemo_seed_reply(self, sid: str, token: str) -> dict[str, Any]:
        """NeMo Gym's seed reply: the id and the MCP access, nothing else (its model forbids it)."""
        return {
            "resources_session_id": sid,
            "resources_tools": {
                "server_name": type(self).__name__,
                "url_path": MCP_PATH,
                "transport": "http",
                "headers": {SESSION_TOKEN_HEADER_NAME: token},
            },
        }

    def _mcp_tools(self, names: list[Any] | None) -> frozenset[str] | None:
        """The start body's ``mcp_tools``: names of this server's tools, or ``None`` for all."""
        if names is None:
            return None
        known = {tool.name for tool in self.tools()}
        unknown = [name for name in names if name not in known]
        if unknown:
            raise InvalidRequestError(
                f"mcp_tools names unknown tools {unknown!r}; this server's tools: {sorted(known)}"
            )
        return frozenset(names)

    async def _verify_route(self, request: Request) -> JSONResponse:
        body = ANY_BODY.validate(await read_json(request))
        sid = session_id(request)
        if self.closed.expired(sid):
            self.refuse_if_closed(sid)
        result = await self.verify_session(sid, body)
        if request.headers.get(CLOSE_FOLLOWS_HEADER) != "1":
            self._end(sid)
        return JSONResponse(result)

    async def _close_route(self, request: Request) -> JSONResponse:
        body = CLOSE_BODY.validate(await read_json(request))
        episode = episode_of(body)
        if request_session(request.scope).source is IdSource.MINTED:
            raise InvalidRequestError(
                "a close must name its session: the session cookie, the session token "
                "or resources_session_id"
            )
        sid = session_id(request)
        self.episodes.check(sid, episode)
        # A close before any seed binds the id too: a late seed of it is refused anyway
        # (closed), and a retried close of another episode is refused as for a seeded one.
        self.episodes.bind(sid, episode)
        outcome = self._end(sid)
        if episode is None:
            return JSONResponse({"resources_session_id": sid, "outcome": outcome})
        if outcome == "release_failed":
            # NeMo's closes raise when releasing fails (its reply has no outcome to say
            # so), and its caller retries: the next close releases again.
            raise EnvError(f"releasing session {sid!r} failed; close it again to retry")
        return JSONResponse({"resources_session_id": sid})

    async def _aggregate_route(self, request: Request) -> JSONResponse:
        body = AGGREGATE_BODY.validate(await read_json(request))
        return JSONResponse(aggregate_verify_responses(body["verify_responses"]))

    # Durable sessions: what this class records of a session travels in its
    # snapshot too, so a restored session answers a repeated seed as before.

    def session_records(self, sid: str) -> dict[str, Any]:
        """The start record and episode binding of ``sid``, for its snapshot."""
        start = self._starts.get(sid)
        return {
            "start": None if start is None else (start.body, start.reply),
            "episode": self.episodes.of(sid),
        }

    def restore_records(self, sid: str, records: dict[str, Any]) -> None:
        """Take back what `session_records` gave (a restored session)."""
        if records.get("start") is not None:
            body, reply = records["start"]
            self._starts[sid] = _StartRecord(body, reply)
        self.episodes.bind(sid, records.get("episode"))

    def _claim_ended(self, sid: str) -> None:
        """The session's claim ended: its records go with it, then its state."""
        self._starts.pop(sid, None)
        self._unreleased.discard(sid)
        self.episodes.forget(sid)
        self.release_session(sid)

    def _forget_snapshot(self, sid: str) -> None:
        # A closed or expired session must never come back from its snapshot.
        if self.snapshots is not None:
            self.snapshots.forget(sid)

    def _expire_idle(self, sid: str) -> None:
        """An open session idled out: close it as its client would have (410 from now on)."""
        self._starts.pop(sid, None)
        self.claims.mark_not_open(sid)
        self._forget_snapshot(sid)
        if self.closed.add(sid, expired=True):
            self.count_expired()
            self.release_session(sid)

    def _end(self, sid: str) -> str:
        """End the session: record the close, release its state, start its window.

        A release that raised is tried again by the next close of the id, so a
        caller can retry a failed close (the close itself stays recorded).
        """
        self._starts.pop(sid, None)
        self.claims.mark_not_open(sid)
        self._forget_snapshot(sid)
        if not self.closed.add(sid) and sid not in self._unreleased:
            return "already_closed"
        try:
            self.release_session(sid)
        except Exception:
            self._unreleased.add(sid)
            return "release_failed"
        self._unreleased.discard(sid)
        return "closed"


def aggregate_verify_responses(responses: list[Any]) -> dict[str, Any]:
    """Means of the numeric fields of ``/verify`` replies (reward, episode_return, ...)."""
    means: dict[str, float] = {}
    counts: dict[str, int] = {}
    for item in responses:
        if not isinstance(item, dict):
            raise InvalidRequestError("verify_responses must be a list of objects")
        for key, value in item.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            try:
                number = float(value)
            except OverflowError:
                raise InvalidRequestError(f"{key} = {value} is too large for a float") from None
            counts[key] = counts.get(key, 0) + 1
            # A running mean cannot overflow where a sum of large values would.
            mean = means.get(key, 0.0)
            means[key] = mean + (number - mean) / counts[key]
    return {"count": len(responses), **{f"mean_{key}": mean for key, mean in means.items()}}
