"""The agent-server base: ``/run`` episodes and agent sessions.

``POST /run`` plays one episode against an env server: a session start, steps
chosen by the agent's policy until the episode ends or ``max_steps``,
``/verify``, and ``/close_session`` in a ``finally``. An env-server failure ends
the run with 502 naming the cause, and the env session is still closed where
it can be.

Agent sessions keep per-session state across requests (conversation, memory).
``POST /v1/agent_sessions`` seeds it through `seed_agent_session`;
``POST /v1/agent_sessions/close`` runs `close_agent_session` and answers a
close receipt, kept for the window so a retried close gets the same one. The
agent decides when its claims end (docs/design.md §3.6):

- a seed that creates nothing releases its claim when it returns;
- state that cannot be registered is released with the close hook and the
  claim with it; if that release fails, the state is kept as a failed seed for
  the caller's close, and dropped a window later by the close hook in the
  background (tried again a window later if the hook raises);
- otherwise the claim lasts until the session's last record (its receipt, or a
  failed seed) is dropped.

A retried seed of a live session with the same body gets ``created: false``
and changes nothing; with another body it is 409 ``session_conflict``. Seeds
and closes carrying NeMo Gym's ``episode_id`` get NeMo's reply shapes and bind
the session to that episode (`gym_sessions.server.episodes`).

What the agent may call is fixed when it starts (`Settings.allowed_envs`,
`Settings.allowed_models`): a body names an env server by name or exact URL
(`env_url`), resolved before anything is sent (`AgentServer.env_url`), and the
shared pool refuses every other URL (`gym_sessions.server.egress`). Env
sessions go through a `ConnectionPool` per allowed env server
(`AgentServer.env_pool`), which sends each session's requests on a connection
of the env worker that holds it, with the same bounds (reply size, no
redirect, timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import pickle
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from gym_sessions.client.connection_pool import ConnectionPool
from gym_sessions.credentials import SessionCredentials
from gym_sessions.errors import (
    EnvError,
    ForbiddenTargetError,
    HTTPError,
    SessionClosedError,
    SessionConflictError,
    SessionExpiredError,
    exception_text,
)
from gym_sessions.routing.owned_claims import OwnedClaims
from gym_sessions.routing.session_ids import AGENT_SOURCES, SESSION_KEY_FIELD, SessionIdSources
from gym_sessions.server.base import SessionServer
from gym_sessions.server.bodies import BodySchema, Field, read_json
from gym_sessions.server.egress import egress_session
from gym_sessions.server.env_session import EnvSession
from gym_sessions.server.episodes import (
    AGENT_SEED_FIELDS,
    CLOSE_FIELDS,
    EpisodeBinding,
    episode_of,
)
from gym_sessions.server.policies import Policy, StopEpisode, act
from gym_sessions.settings import Settings
from gym_sessions.upstreams import UpstreamTargets

__all__ = ["AGENT_CLOSE_PATH", "AGENT_SEED_PATH", "AgentServer"]

logger = logging.getLogger("gym_sessions.agent")

AGENT_SEED_PATH = "/v1/agent_sessions"
AGENT_CLOSE_PATH = "/v1/agent_sessions/close"

RUN_BODY = BodySchema(
    {
        "env_url": Field(
            ("string",),
            required=True,
            description="an env server the agent was started with (--allow-env): its name or URL",
        ),
        "seed": Field(("integer", "null")),
        "options": Field(("object", "null")),
        "max_steps": Field(("integer", "null")),
        "task": Field(("object", "null")),
    },
    allow_extra=True,
)
SEED_BODY = BodySchema(
    {
        "agent_session_id": Field(("string",), required=True),
        SESSION_KEY_FIELD: Field(("string", "null")),
        **AGENT_SEED_FIELDS,
    },
    allow_extra=True,
)
CLOSE_BODY = BodySchema(
    {
        "agent_session_id": Field(("string",), required=True),
        SESSION_KEY_FIELD: Field(("string", "null")),
        **CLOSE_FIELDS,
    }
)


@dataclass
class _FailedSeed:
    state: Any
    retry_at: float


#: Connections to each env server (the aiohttp pool's limit for all upstreams).
_ENV_POOL_CONNECTIONS = 256


class AgentServer(SessionServer):
    """Base of agent servers: subclasses choose the policy and the agent-session hooks."""

    sources: ClassVar[SessionIdSources] = AGENT_SOURCES
    close_paths: ClassVar[tuple[str, ...]] = (AGENT_CLOSE_PATH,)
    #: With ``--durable-sessions``: an agent session's state (what
    #: `seed_agent_session` returned) pickles, so it can be restored on another
    #: worker. A subclass that sets it calls `session_changed` in every route of
    #: its own that changes the state (seeds and closes do here). Receipts and
    #: failed seeds are not captured.
    durable_agent_state: ClassVar[bool] = False

    def __init__(self) -> None:
        self.agent_sessions: dict[str, Any] = {}
        self._receipts: dict[str, tuple[dict[str, Any], float]] = {}
        self._failed: dict[str, _FailedSeed] = {}
        self._http: aiohttp.ClientSession | None = None
        self._env_pools: dict[str, ConnectionPool] = {}
        self._spaces: dict[str, dict[str, Any]] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._expiring: set[asyncio.Future[None]] = set()
        #: The body each live agent session was seeded with (a retry must match it).
        self._seed_bodies: dict[str, dict[str, Any]] = {}
        self.episodes = EpisodeBinding()
        self.env_targets = UpstreamTargets("env")
        self.model_targets = UpstreamTargets("model")

    @property
    def start_paths(self) -> tuple[str, ...]:
        return (AGENT_SEED_PATH,)

    @property
    def window(self) -> float:
        return self.settings.session_close_retry_window_seconds

    # Upstreams ---------------------------------------------------------------------------

    def env_url(self, reference: str) -> str:
        """The env server a body names (a name or an exact URL of ``--allow-env``).

        Raises:
            ForbiddenTargetError: it names no env server this agent may call.
        """
        return self.env_targets.resolve(reference)

    def model_url(self, reference: str) -> str:
        """The model server a body names (a name or an exact URL of ``--allow-model``).

        Raises:
            ForbiddenTargetError: it names no model server this agent may call.
        """
        return self.model_targets.resolve(reference)

    def may_call(self, url: str) -> bool:
        """Whether ``url`` is under an allowed env or model server (the pool's rule)."""
        return self.env_targets.covers(url) or self.model_targets.covers(url)

    # Hooks -------------------------------------------------------------------------------

    def check_run(self, body: dict[str, Any]) -> None:
        """Refuse a ``/run`` body this agent cannot play (raise `InvalidRequestError`)."""

    def make_policy(self, body: dict[str, Any], spaces: dict[str, Any]) -> Policy:
        """The policy for one ``/run`` (``spaces`` is the env server's ``/spaces``)."""
        raise NotImplementedError

    def start_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The env session start's body for one ``/run`` (seed and options by default)."""
        return {"seed": body.get("seed"), "options": body.get("options")}

    async def seed_agent_session(self, session_id: str, body: dict[str, Any]) -> Any:
        """Create an agent session's state; ``None`` means the seed creates nothing."""
        return None

    def register_agent_session(self, session_id: str, state: Any) -> None:
        """Register seeded state (may refuse by raising)."""
        self.agent_sessions[session_id] = state

    async def close_agent_session(self, session_id: str, state: Any) -> dict[str, Any]:
        """Release an agent session's state; returns extra receipt fields."""
        return {}

    def extra_routes(self) -> list[BaseRoute]:
        """Routes a subclass adds (they may use `agent_state`)."""
        return []

    # Durable sessions (docs/design.md §3.14) -----------------------------------------

    def durability(self) -> str | None:
        return "agent session state, pickled" if self.durable_agent_state else None

    def export_session(self, session_id: str) -> bytes | None:
        if not self.durable_agent_state or session_id not in self.agent_sessions:
            return None
        # The seed's body and episode go along: a restored session answers a
        # retried seed (same body: not created again; another: 409) as before.
        snapshot = {
            "state": self.agent_sessions[session_id],
            "seed_body": self._seed_bodies.get(session_id),
            "episode": self.episodes.of(session_id),
        }
        try:
            return pickle.dumps(snapshot)
        except Exception:
            return None  # this session's state does not pickle: not durable (logged once)

    def import_session(self, session_id: str, data: bytes) -> None:
        # Only bytes whose MAC verified reach here (`SnapshotCodec.decode`).
        snapshot = pickle.loads(data)
        self.agent_sessions[session_id] = snapshot["state"]
        if snapshot["seed_body"] is not None:
            self._seed_bodies[session_id] = snapshot["seed_body"]
        self.episodes.bind(session_id, snapshot["episode"])

    def agent_state(self, request: Request) -> Any:
        """The state of the request's agent session, or ``None``.

        Raises:
            SessionExpiredError: the session idled out and the server closed it.
        """
        sid = self.session_id(request)
        self._refuse_if_expired(sid)
        return self.agent_sessions.get(sid)

    def _refuse_if_expired(self, sid: str) -> None:
        receipt = self._receipts.get(sid)
        if receipt is not None and receipt[0]["outcome"] == "expired":
            raise SessionExpiredError(
                f"agent session {sid!r} had no request for "
                f"{self.settings.session_idle_timeout:g} s and was closed"
            )

    # Routes ------------------------------------------------------------------------------

    def routes(self) -> list[BaseRoute]:
        return [
            *super().routes(),
            Route("/run", self._run_route, methods=["POST"]),
            Route(AGENT_SEED_PATH, self._seed_route, methods=["POST"]),
            Route(AGENT_CLOSE_PATH, self._close_route, methods=["POST"]),
            *self.extra_routes(),
        ]

    def metrics(self) -> dict[str, Any]:
        return {
            "agent_sessions": len(self.agent_sessions),
            "receipts": len(self._receipts),
            "failed_seeds": len(self._failed),
        }

    async def _run_route(self, request: Request) -> JSONResponse:
        body = RUN_BODY.validate(await read_json(request))
        self.env_url(body["env_url"])  # refused before any hook or connection runs
        self.check_run(body)
        return JSONResponse(await self.run_episode(body))

    async def run_episode(self, body: dict[str, Any]) -> dict[str, Any]:
        """Play one episode against the env server ``body["env_url"]`` names; see the module.

        Raises:
            ForbiddenTargetError: it names no env server this agent may call.
        """
        url = self.env_url(body["env_url"])
        env = EnvSession(self.env_pool(url), url)
        spaces = self._spaces.get(env.url) or await env.spaces()
        self._spaces[env.url] = spaces
        policy = self.make_policy(body, spaces)
        max_steps = body.get("max_steps")
        episode_return, length = 0.0, 0
        try:
            reply = await env.start(self.start_body(body))
            observation, info = reply["observation"], reply["info"]
            done = False
            while not done and (max_steps is None or length < max_steps):
                try:
                    action = await act(policy, observation, info)
                except StopEpisode:
                    break
                step = await env.step(action)
                observation, info = step["observation"], step["info"]
                episode_return += step["reward"]
                length += 1
                done = step["terminated"] or step["truncated"]
            verified = await env.verify()
        finally:
            if env.started:
                with contextlib.suppress(HTTPError):
                    await env.close()
        return {
            "reward": verified["reward"],
            "episode_return": episode_return,
            "episode_length": length,
            "env_session_id": env.session_id,
            "verify": verified,
        }

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, sid: str) -> AsyncIterator[None]:
        """Seeds and closes of one id run one after another: their hooks may await."""
        lock, users = self._locks.get(sid, (asyncio.Lock(), 0))
        self._locks[sid] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[sid]
            if users == 1:
                del self._locks[sid]
            else:
                self._locks[sid] = (lock, users - 1)

    async def _seed_route(self, request: Request) -> JSONResponse:
        body = SEED_BODY.validate(await read_json(request))
        body.pop(SESSION_KEY_FIELD, None)  # a credential, not data for the seed hook
        episode = episode_of(body)
        sid = self.session_id(request)
        async with self._one_at_a_time(sid):
            created = await self._seed(sid, body, episode)
        if episode is not None:
            return JSONResponse({"agent_session_id": sid})  # NeMo's reply has no more
        return JSONResponse({"agent_session_id": sid, "created": created})

    async def _seed(self, sid: str, body: dict[str, Any], episode: tuple[str, int] | None) -> bool:
        """Seed ``sid`` unless it is live with the same body; whether state was created."""
        if sid in self._receipts:
            self._refuse_if_expired(sid)
            raise SessionClosedError(f"agent session {sid!r} was closed")
        fields = {k: v for k, v in body.items() if k != self.sources.body_key}
        if sid in self.agent_sessions:
            self.episodes.check(sid, episode)
            if fields != self._seed_bodies.get(sid):
                raise SessionConflictError(
                    f"agent session {sid!r} was seeded with another body; close it, or seed "
                    "another id"
                )
            return False
        if sid in self._failed:
            raise SessionConflictError(
                f"agent session {sid!r} has state whose release failed: close it first"
            )
        fields = copy.deepcopy(fields)  # the hook may change the body it is given
        try:
            state = await self.seed_agent_session(sid, body)
        except HTTPError:
            self.claims.release_now(sid)
            raise
        except Exception as exc:
            self.claims.release_now(sid)
            raise EnvError(f"seeding agent session {sid!r} failed: {exception_text(exc)}") from exc
        if state is None:
            self.claims.release_now(sid)  # nothing to route to
            return False
        try:
            self.register_agent_session(sid, state)
        except Exception as exc:
            await self._roll_back(sid, state)
            raise EnvError(
                f"agent session {sid!r} could not be registered: {exception_text(exc)}"
            ) from exc
        self._seed_bodies[sid] = fields
        self.episodes.bind(sid, episode)
        self.claims.mark_open(sid)
        self.session_changed(sid)
        return True

    async def _roll_back(self, sid: str, state: Any) -> None:
        try:
            await self.close_agent_session(sid, state)
        except Exception:
            logger.warning("rolling back agent session %r failed; kept for its close", sid)
            self._failed[sid] = _FailedSeed(state, time.monotonic() + self.window)
            self.claims.mark_open(sid, live=False)  # the caller's close must reach this worker
        else:
            self.claims.release_now(sid)

    async def _close_route(self, request: Request) -> JSONResponse:
        body = CLOSE_BODY.validate(await read_json(request))
        episode = episode_of(body)
        sid = self.session_id(request)
        async with self._one_at_a_time(sid):
            self.episodes.check(sid, episode)
            # A close of an id never seeded binds it as well, so a retried close of
            # another episode is refused as for a seeded one.
            self.episodes.bind(sid, episode)
            receipt = self._receipts.get(sid) or await self._close(sid)
        if episode is None:
            return JSONResponse(receipt[0])
        # NeMo's close reply: the receipt without its outcome; a failed release raises.
        if receipt[0]["outcome"] == "release_failed":
            raise EnvError(f"closing agent session {sid!r} failed; close it again to retry")
        return JSONResponse({k: v for k, v in receipt[0].items() if k != "outcome"})

    async def _close(self, sid: str) -> tuple[dict[str, Any], float]:
        self._seed_bodies.pop(sid, None)
        self.session_changed(sid)  # its snapshot goes with it
        state = self.agent_sessions.pop(sid, None)
        failed = self._failed.pop(sid, None)
        if failed is not None:
            state = failed.state
        outcome, extra = "not_found", {}
        if state is not None:
            try:
                extra = await self.close_agent_session(sid, state)
                outcome = "closed"
            except Exception as exc:
                logger.warning("closing agent session %r failed: %s", sid, exc)
                outcome = "release_failed"
        receipt = ({"agent_session_id": sid, "outcome": outcome, **extra}, time.monotonic())
        # Held by the receipt (or the kept state) until the background drops it;
        # no live session now.
        self.claims.mark_open(sid, live=False)
        if outcome == "release_failed":
            # Not a receipt to keep: the state stays, as a failed seed's does, so a
            # retried close runs the hook again (and the background does, a window
            # later); a seed meanwhile is 409.
            self._failed[sid] = _FailedSeed(state, time.monotonic() + self.window)
            return receipt
        self._receipts[sid] = receipt
        return receipt

    # Background: drop receipts after the window, retry failed seeds -----------------------

    async def background(self) -> None:
        try:
            while True:
                await asyncio.sleep(min(1.0, max(0.02, self.window / 10)))
                try:
                    await self._expire_records()
                except Exception:  # keep expiring later records
                    logger.exception("expiring agent records failed")
        finally:
            await self.close_upstreams()

    async def _expire_records(self) -> None:
        now = time.monotonic()
        for sid, (_, written_at) in list(self._receipts.items()):
            if written_at + self.window <= now:
                del self._receipts[sid]
                self._release_if_unused(sid)
        for sid, failed in list(self._failed.items()):
            if failed.retry_at <= now:
                await self._drop_failed_seed(sid, failed)

    async def _drop_failed_seed(self, sid: str, failed: _FailedSeed) -> None:
        try:
            await self.close_agent_session(sid, failed.state)
        except Exception:
            failed.retry_at = time.monotonic() + self.window
            logger.warning("dropping failed agent seed %r failed; retrying later", sid)
            return
        if self._failed.get(sid) is failed:
            del self._failed[sid]
            self._release_if_unused(sid)

    def _release_if_unused(self, sid: str) -> None:
        if sid not in self.agent_sessions and sid not in self._receipts and sid not in self._failed:
            self.episodes.forget(sid)
            self.claims.release_now(sid)

    def http_client(self) -> aiohttp.ClientSession:
        """The agent's shared aiohttp pool (model servers; env sessions use `env_pool`).

        It calls only URLs under the allowed upstreams (`may_call`), follows no
        redirect and reads at most ``upstream_max_reply_bytes`` of a reply
        (`gym_sessions.server.egress`).
        """
        if self._http is None or self._http.closed:
            self._http = egress_session(
                self.may_call,
                max_reply_bytes=self.settings.upstream_max_reply_bytes,
                connect_timeout=self.settings.upstream_connect_timeout,
                total_timeout=self.settings.upstream_timeout,
            )
        return self._http

    def env_pool(self, url: str) -> ConnectionPool:
        """The connections to env server ``url`` (an allowed one, `env_url`), shared by runs.

        Each env session's requests go on a connection of the env worker that
        holds it (`ConnectionPool`), so a busy agent's requests do not hop
        between the env server's workers. Bounded as the aiohttp pool is: at
        most ``upstream_max_reply_bytes`` of a reply (after decompression
        too), no redirect; ``upstream_connect_timeout`` per connect,
        ``upstream_timeout`` per reply and for a free connection; up to 256
        connections per env server.

        Raises:
            ForbiddenTargetError: ``url`` is under no allowed env server.
        """
        pool = self._env_pools.get(url)
        if pool is None:
            if not self.env_targets.covers(url):
                # The backstop the aiohttp pool's connector is for model servers.
                raise ForbiddenTargetError(f"{url} is not an env server this agent may call")
            pool = self._env_pools[url] = ConnectionPool(
                url,
                max_connections=_ENV_POOL_CONNECTIONS,
                timeout=self.settings.upstream_timeout,
                connect_timeout=self.settings.upstream_connect_timeout,
                max_reply_bytes=self.settings.upstream_max_reply_bytes,
            )
        return pool

    async def close_upstreams(self) -> None:
        """Close the pools to env and model servers (a later call opens new ones)."""
        pools, self._env_pools = self._env_pools, {}
        for pool in pools.values():
            await pool.close()
        if self._http is not None:
            await self._http.close()

    def _attach(
        self, settings: Settings, claims: OwnedClaims, credentials: SessionCredentials
    ) -> None:
        super()._attach(settings, claims, credentials)
        self.env_targets = settings.env_targets()
        self.model_targets = settings.model_targets()
        claims.on_idle(self._expire_idle)

    def check_settings(self, settings: Settings) -> None:
        super().check_settings(settings)
        if not settings.allowed_envs:
            logger.warning(
                "%s: started with no --allow-env, so /run calls no env server: every /run "
                "gets 400 forbidden_target (docs/security.md)",
                type(self).__name__,
            )

    def _expire_idle(self, sid: str) -> None:
        """A live agent session idled out: release it in the background; its receipt says so."""
        state = self.agent_sessions.pop(sid, None)
        if state is None:
            return
        self._seed_bodies.pop(sid, None)
        self.count_expired()
        self._receipts[sid] = ({"agent_session_id": sid, "outcome": "expired"}, time.monotonic())
        self.claims.mark_open(sid, live=False)  # held by the receipt, as after a close
        task = asyncio.ensure_future(self._release_expired(sid, state))
        self._expiring.add(task)
        task.add_done_callback(self._expiring.discard)

    async def _release_expired(self, sid: str, state: Any) -> None:
        async with self._one_at_a_time(sid):
            try:
                await self.close_agent_session(sid, state)
            except Exception:
                logger.warning("closing idle agent session %r failed", sid, exc_info=True)

    def release_all(self) -> None:
        self.agent_sessions.clear()
        self._seed_bodies.clear()
        self.episodes.clear()
        self._failed.clear()
