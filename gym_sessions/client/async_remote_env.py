"""`AsyncRemoteEnv`: the `RemoteEnv` API with ``await``, many sessions per event loop."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.utils import seeding

from gym_sessions.client import lifecycle, sigterm
from gym_sessions.client.async_http import AsyncHTTPClient
from gym_sessions.client.async_websocket import AsyncWebSocketClient
from gym_sessions.client.connection_pool import ConnectionPool
from gym_sessions.client.protocol import (
    SPACES_REQUEST,
    EnvDescription,
    RemoteEnvProtocol,
    batch_request,
    batch_results,
)
from gym_sessions.client.tls import CertOption, VerifyOption, tls_context
from gym_sessions.errors import (
    BadGatewayError,
    ConnectionLostError,
    InternalServerError,
    SessionGoneError,
    error_from_body,
)
from gym_sessions.wire import START_BESIDE_HEADER

__all__ = ["AsyncRemoteEnv"]


class AsyncRemoteEnv:
    """One session on a gym-sessions server, driven with ``await``.

    The same requests, replies, errors and retry rules as `RemoteEnv` (both are
    shells around `RemoteEnvProtocol`), over one kept-alive asyncio HTTP/1.1
    connection (`gym_sessions.client.http11`), so any number of envs share one
    event loop, one session each.
    Open it with ``async with`` or `create` (both read the spaces from
    ``GET /spaces``); leaving the ``async with`` block closes the session. A
    ``reset()`` after ``close()`` starts a new session (a new id and key).

    An env that is garbage-collected or still open at interpreter exit closes
    its session by itself (with a blocking request of at most about 2 s, even
    inside a running event loop, or after ``asyncio.run`` has closed the loop)
    and its connection, without raising or printing "Unclosed" warnings
    (`gym_sessions.client.lifecycle`). ``await close()`` to know it worked.

    Example:
        >>> async with AsyncRemoteEnv("http://127.0.0.1:8000") as env:
        ...     obs, info = await env.reset(seed=0)
        ...     obs, reward, terminated, truncated, info = await env.step(1)
        >>> env = await AsyncRemoteEnv.create("http://127.0.0.1:8000")
        >>> await env.close()

    Args:
        url: The server's base URL.
        render_mode: As for `RemoteEnv`.
        timeout: Seconds to wait for each reply.
        keep_alive: Keep one connection for the session.
        retries: Resends of a request that is safe to resend after a lost reply.
        headers: Extra headers sent with every request, the close at exit
            included (an authenticating proxy's, say: ``{"X-Proxy-Auth": "..."}``).
        verify: As for `RemoteEnv` (``https://`` URLs).
        cert: As for `RemoteEnv` (``https://`` URLs).
        description: The served env, when already known (a vector env reads
            ``/spaces`` once for all its sessions); read on `open` otherwise.
        close_at_exit: Close the session at garbage collection or exit if it is
            still open. ``False`` when the owner does that itself (a
            `RemoteVectorEnv` closes all its sessions at once, on its loop).
        transport: ``"http"`` (the default), or ``"ws"``: every request of the
            session as a message of one WebSocket (``/ws``). A
            dropped WebSocket is reopened with the session cookie and reaches
            the same session; a step whose reply it lost ran once or not at all
            (as over HTTP: `ConnectionLostError` says when it ran). Values are
            binary frames where the server offers the binary encoding.
        pool: A `ConnectionPool` of ``url`` for this env's requests (HTTP
            only), shared with other envs: each request goes on a connection
            of the worker holding its session. ``timeout``, ``verify`` and
            ``cert`` are then the pool's; ``close()`` leaves it open.
    """

    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    metadata: dict[str, Any]

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        render_mode: str | None = None,
        timeout: float = 60.0,
        keep_alive: bool = True,
        retries: int = 1,
        headers: Mapping[str, str] | None = None,
        verify: VerifyOption = True,
        cert: CertOption | None = None,
        *,
        description: EnvDescription | None = None,
        close_at_exit: bool = True,
        transport: str = "http",
        pool: ConnectionPool | None = None,
    ) -> None:
        self.url = url
        self.render_mode = render_mode
        self.transport = transport
        self._http: AsyncHTTPClient | AsyncWebSocketClient
        if transport == "ws":
            if pool is not None:
                raise ValueError("a WebSocket is the session's own connection: no pool")
            self._http = AsyncWebSocketClient(
                url,
                timeout=timeout,
                retries=retries,
                headers=headers,
                ssl_context=tls_context(url, verify, cert),
            )
        elif transport == "http":
            self._http = AsyncHTTPClient(
                url,
                timeout=timeout,
                keep_alive=keep_alive,
                retries=retries,
                headers=headers,
                ssl_context=None if pool is not None else tls_context(url, verify, cert),
                pool=pool,
            )
        else:
            raise ValueError(f"transport must be 'http' or 'ws', not {transport!r}")
        self._protocol: RemoteEnvProtocol | None = None
        self._np_random: np.random.Generator | None = None
        self._np_random_seed: int | None = None
        self._close_at_exit = close_at_exit
        #: Another env whose connection this env's sessions start over (`RemoteVectorEnv`
        #: sets it: sessions started over one connection are held by one worker,
        #: so one step batch steps them all); ``None``: this env's own.
        self.starts_over: AsyncRemoteEnv | None = None
        if description is not None:
            self._describe(description)

    @classmethod
    async def create(cls, url: str = "http://127.0.0.1:8000", **kwargs: Any) -> AsyncRemoteEnv:
        """An opened env (same arguments as the constructor)."""
        env = cls(url, **kwargs)
        await env.open()
        return env

    def _describe(self, description: EnvDescription) -> None:
        self._protocol = RemoteEnvProtocol(description, self.render_mode)
        self.observation_space = description.observation_space
        self.action_space = description.action_space
        self.metadata = description.metadata
        if self._close_at_exit:
            lifecycle.close_at_exit(self, self._http, self._protocol, self._http.close_soon)

    async def open(self) -> AsyncRemoteEnv:
        """Read the spaces (unless given) and check the render mode; returns ``self``."""
        if self._protocol is None:
            try:
                reply = await self._http.send(SPACES_REQUEST)
                self._describe(EnvDescription.from_json(reply.json()))
            except BaseException:
                await self._http.close()
                raise
        return self

    @property
    def protocol(self) -> RemoteEnvProtocol:
        if self._protocol is None:
            raise RuntimeError("open the AsyncRemoteEnv first: `async with` or `await create()`")
        return self._protocol

    @property
    def description(self) -> EnvDescription:
        """The served env (spaces, metadata, spec)."""
        return self.protocol.description

    @property
    def session_id(self) -> str:
        """The current session's id (picked by the client; a new one after ``close()``)."""
        return self.protocol.session_id

    @property
    def worker(self) -> str | None:
        """The worker holding the session (from ``/health`` after its first reset, and batches).

        ``None`` over ``transport="ws"``, which asks no ``/health``.
        """
        return self._protocol.worker if self._protocol is not None else None

    @property
    def np_random(self) -> np.random.Generator:
        """A generator seeded by ``reset(seed=...)``, as `gymnasium.Env.np_random`."""
        if self._np_random is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        return self._np_random

    @property
    def np_random_seed(self) -> int:
        """The seed of `np_random` (a random one until ``reset(seed=...)``), as Gymnasium's."""
        if self._np_random_seed is None:
            self._np_random, self._np_random_seed = seeding.np_random()
        return self._np_random_seed

    @property
    def starts_session(self) -> bool:
        """Whether the next `reset` starts a new session (the server places it on a worker)."""
        protocol = self.protocol
        return protocol.closed or not protocol.started

    @property
    def starts_beside_leader(self) -> bool:
        """Whether the next `reset` starts a new session beside `starts_over`'s (a batch group)."""
        if self.starts_over is None or self.starts_over is self:
            return False
        return self.starts_session

    async def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Start (or restart) the session's episode; returns observation and info."""
        sigterm.stop_if_terminated()
        protocol = self.protocol
        sigterm.hold(self)  # SIGTERM closes the session as Ctrl-C does
        if seed is not None:
            self._np_random, self._np_random_seed = seeding.np_random(seed)
        # A session's first start picks its worker; later resets reach it anyway.
        first_start = self.starts_session
        request = protocol.reset_request(seed, options)
        over = None
        leader = self.starts_over
        if leader is not None and first_start and isinstance(leader._http, AsyncHTTPClient):
            # (Over /ws a session starts where its connection is: no batch group.)
            over = leader._http
            leader_cookie = over.cookie
            if leader_cookie is not None:
                # With balanced placement a start goes to the least busy worker:
                # ask for the leader's, so that one batch steps the whole group.
                headers = {**request.headers, START_BESIDE_HEADER: leader_cookie}
                request = dataclasses.replace(request, headers=headers)
        if over is not None and isinstance(self._http, AsyncHTTPClient):
            reply = await self._http.send(request, over=over)
        else:
            reply = await self._http.send(request)
        observation, info = protocol.reset_reply(reply)
        if protocol.worker is None and self.transport == "http":
            # For step batches' groups; a WebSocket's session steps alone (no batches).
            protocol.health_reply(await self._http.send(protocol.health_request()))
        return observation, info

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """Take one action; returns observation, reward, terminated, truncated and info."""
        sigterm.stop_if_terminated()
        protocol = self.protocol
        reply = await self._http.send_step(protocol.step_recovery(action))
        return protocol.step_reply(reply)

    # Step batches (`gym_sessions.client.step_batch`) -------------------------------------

    def batch_entry(self, action: Any) -> dict[str, Any] | None:
        """This session's entry of a step batch; ``None`` without a session cookie yet."""
        cookie = self._http.cookie
        if cookie is None:
            return None
        return {
            "cookie": cookie,
            "action": self.protocol.encode_action(action),
            # As a /step's x-gym-episode-length: a late first send never runs twice.
            "episode_length": self.protocol.episode_length,
        }

    async def send_batch(self, path: str, entries: list[dict[str, Any]]) -> list[Any]:
        """Send a step batch over this env's connection; returns its per-entry results."""
        results = batch_results(await self._http.send(batch_request(path, entries)))
        if not isinstance(results, list):
            raise InternalServerError("a step batch reply must hold a list of results")
        return results

    def batch_result(self, result: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """This session's step from its batch result; raises the error ``/step`` would have."""
        if not isinstance(result, dict):
            raise InternalServerError(f"a step batch result must be an object, not {result!r}")
        worker = result.get("worker")
        if isinstance(worker, str):
            self.protocol.worker = worker  # the holder, which groups the next batch
        if "error" in result:
            status = result.get("status")
            raise error_from_body(
                status if isinstance(status, int) else 500, json.dumps(result).encode()
            )
        return self.protocol.step_result(result)

    async def recover_lost_step(
        self, action: Any, lost: ConnectionLostError | BadGatewayError
    ) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """This session's step after its batch's reply (or its entry's hop) was lost.

        As a lost ``/step`` recovers (`StepRecovery`): ``/observe``, then the
        resend at the step's episode length, or "it ran".
        """
        protocol = self.protocol
        recovery = protocol.step_recovery(action)
        recovery.failed(lost)  # asks /observe next: did the step run?
        return protocol.step_reply(await self._http.send_step(recovery))

    async def render(self) -> Any:
        """The served env's frame in this env's `render_mode` (``None`` without one)."""
        if self.render_mode is None:
            return None
        protocol = self.protocol
        return protocol.render_reply(await self._http.send(protocol.render_request()))

    async def verify(self, *, close_follows: bool = True, **body: Any) -> dict[str, Any]:
        """Score the episode on the server (``/verify``), as `RemoteEnv.verify`."""
        request = self.protocol.verify_request(close_follows, body)
        return (await self._http.send(request)).json()

    async def close(self) -> None:
        """Close the session on the server (once) and the connection.

        A later ``reset()`` starts a new session.

        Raises:
            GymSessionsError: the server could not be reached or refused the close.
        """
        request = self._protocol.claim_close() if self._protocol is not None else None
        try:
            if request is not None:
                with contextlib.suppress(SessionGoneError):  # nothing left to close
                    await self._http.send(request)
        finally:
            await self._http.close()
            sigterm.release(self)

    async def __aenter__(self) -> AsyncRemoteEnv:
        return await self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()
