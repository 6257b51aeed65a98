"""`RemoteEnv`: the Gymnasium API on an environment served by gym-sessions."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from gym_sessions.client import sigterm
from gym_sessions.client.http import HTTPClient
from gym_sessions.client.lifecycle import close_at_exit
from gym_sessions.client.protocol import (
    SPACES_REQUEST,
    WIRE_RENDER_MODES,
    EnvDescription,
    RemoteEnvProtocol,
)
from gym_sessions.client.tls import CertOption, VerifyOption, tls_context
from gym_sessions.errors import SessionGoneError

__all__ = ["RemoteEnv"]


class RemoteEnv(gym.Env):
    """A Gymnasium env whose episodes run on a gym-sessions server.

    Each instance is one session on the server, named by an id the client picks,
    so a retried reset can never create a second session. ``reset(seed=...)``
    seeds the server's env and this object's ``np_random``. After the first
    reset, `worker` names the server worker that holds the session.

    ``close()`` closes the session; a ``reset()`` after it starts a new session
    (a new id and key), as a local env may be reset after ``close()``. An env
    that is garbage-collected or still open at interpreter exit closes its
    session by itself: best effort, at most about 2 s, never raising
    (`gym_sessions.client.lifecycle`). Call ``close()`` to know it worked.

    Example:
        >>> import gymnasium, gym_sessions
        >>> env = gymnasium.make("gym_sessions/Remote-v0", url="http://127.0.0.1:8000")
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> env.close()

    Args:
        url: The server's base URL.
        render_mode: One of the served env's render modes that travel over HTTP
            (``rgb_array``, ``depth_array``, ``ansi``); the server makes the
            session's env with it. ``gymnasium.make(..., render_mode="human")``
            shows ``rgb_array`` frames in a local window.
        timeout: Seconds to wait for each reply.
        keep_alive: Keep one connection for the session (no routing hop needed).
        retries: Resends of a request that is safe to resend after a lost reply
            (see `gym_sessions.client.protocol`); a step is never resent blindly.
        headers: Extra headers sent with every request, the close at exit
            included (an authenticating proxy's, say: ``{"X-Proxy-Auth": "..."}``).
            A ``Cookie`` here is sent along with the session cookie.
        verify: For an ``https://`` URL: check the server's certificate against
            the system's CAs (``True``), a CA file's (a path), or not at all
            (``False``); or an `ssl.SSLContext` of your own (`gym_sessions.client.tls`).
        cert: A client certificate for an ``https://`` server or proxy that
            asks for one: a PEM file with certificate and key, or a
            ``(certificate, key)`` pair of files.
    """

    # What gymnasium.make checks a requested render_mode against before the
    # instance exists; the instance narrows it to what the served env offers.
    metadata: dict[str, Any] = {"render_modes": list(WIRE_RENDER_MODES)}
    _spec: EnvSpec | None = None

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
    ) -> None:
        self.url = url
        self._http = HTTPClient(
            url,
            timeout=timeout,
            keep_alive=keep_alive,
            retries=retries,
            headers=headers,
            ssl_context=tls_context(url, verify, cert),
        )
        try:
            description = EnvDescription.from_json(self._http.send(SPACES_REQUEST).json())
            self._protocol = RemoteEnvProtocol(description, render_mode)
        except BaseException:
            self._http.close()
            raise
        self.observation_space = description.observation_space
        self.action_space = description.action_space
        self.metadata = description.metadata
        self.render_mode = render_mode
        close_at_exit(self, self._http, self._protocol, self._http.close)

    @property
    def spec(self) -> EnvSpec | None:
        """The spec ``gymnasium.make`` gave, with the served env's episode limits.

        ``max_episode_steps`` and ``reward_threshold`` are the served env's
        unless the spec sets them (`EnvDescription.local_spec`); ``None`` for
        an env made without ``gymnasium.make``, as for a local env.
        """
        return self._spec

    @spec.setter
    def spec(self, spec: EnvSpec | None) -> None:
        self._spec = self._protocol.description.local_spec(spec)

    @property
    def session_id(self) -> str:
        """The current session's id (picked by the client; a new one after ``close()``)."""
        return self._protocol.session_id

    @property
    def worker(self) -> str | None:
        """The worker holding the session (from ``GET /health`` after the session's first reset)."""
        return self._protocol.worker

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        sigterm.stop_if_terminated()
        super().reset(seed=seed)
        sigterm.hold(self)  # SIGTERM closes the session as Ctrl-C does
        reply = self._http.send(self._protocol.reset_request(seed, options))
        observation, info = self._protocol.reset_reply(reply)
        if self._protocol.worker is None:
            self._protocol.health_reply(self._http.send(self._protocol.health_request()))
        return observation, info

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        sigterm.stop_if_terminated()
        reply = self._http.send_step(self._protocol.step_recovery(action))
        return self._protocol.step_reply(reply)

    def render(self) -> Any:
        """The served env's frame in this env's `render_mode` (``None`` without one)."""
        if self.render_mode is None:
            return None
        return self._protocol.render_reply(self._http.send(self._protocol.render_request()))

    def verify(self, *, close_follows: bool = True, **body: Any) -> dict[str, Any]:
        """Score the episode on the server (``/verify``).

        Args:
            close_follows: Keep the session open for a later `close` (the default);
                ``False`` lets the server end the session now.
            body: Extra fields for the server's verifier.
        """
        return self._http.send(self._protocol.verify_request(close_follows, body)).json()

    def close(self) -> None:
        """Close the session on the server (once) and the connection.

        A later ``reset()`` starts a new session.

        Raises:
            GymSessionsError: the server could not be reached or refused the close.
        """
        request = self._protocol.claim_close()
        try:
            if request is not None:
                with contextlib.suppress(SessionGoneError):  # nothing left to close
                    self._http.send(request)
        finally:
            self._http.close()
            sigterm.release(self)
