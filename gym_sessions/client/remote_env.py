"""`RemoteEnv`: the Gymnasium API on an environment served by gym-sessions."""

from __future__ import annotations

import uuid
from typing import Any

import gymnasium as gym

from gym_sessions.client.http import HTTPClient
from gym_sessions.spaces import space_from_json, value_from_json, value_to_json

__all__ = ["RemoteEnv"]


class RemoteEnv(gym.Env):
    """A Gymnasium env whose episodes run on a gym-sessions server.

    Each instance is one session on the server, named by an id the client picks,
    so a retried reset can never create a second session. ``reset(seed=...)``
    seeds the server's env and this object's ``np_random``.

    Example:
        >>> import gymnasium, gym_sessions
        >>> env = gymnasium.make("gym_sessions/Remote-v0", url="http://127.0.0.1:8000")
        >>> obs, info = env.reset(seed=0)
        >>> obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        >>> env.close()

    Args:
        url: The server's base URL.
        render_mode: Must be ``None`` for now.
        timeout: Seconds to wait for each reply.
        keep_alive: Keep one connection for the session (no routing hop needed).
    """

    def __init__(
        self,
        url: str = "http://127.0.0.1:8000",
        render_mode: str | None = None,
        timeout: float = 60.0,
        keep_alive: bool = True,
    ) -> None:
        self.url = url
        self._http = HTTPClient(url, timeout=timeout, keep_alive=keep_alive)
        described = self._http.request("GET", "/spaces")
        self.observation_space = space_from_json(described["observation_space"])
        self.action_space = space_from_json(described["action_space"])
        self.metadata = {**described.get("metadata", {}), "render_modes": []}
        if render_mode is not None:
            raise ValueError(f"render_mode {render_mode!r} is not supported by RemoteEnv yet")
        self.render_mode = render_mode
        self.session_id = uuid.uuid4().hex
        self._started = False
        self._closed = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        reply = self._http.request(
            "POST",
            "/reset",
            {"resources_session_id": self.session_id, "seed": seed, "options": options},
        )
        self._started = True
        return value_from_json(self.observation_space, reply["observation"]), reply["info"]

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        reply = self._http.request(
            "POST", "/step", {"action": value_to_json(self.action_space, action)}
        )
        return (
            value_from_json(self.observation_space, reply["observation"]),
            reply["reward"],
            reply["terminated"],
            reply["truncated"],
            reply["info"],
        )

    def verify(self, *, close_follows: bool = True, **body: Any) -> dict[str, Any]:
        """Score the episode on the server (``/verify``).

        Args:
            close_follows: Keep the session open for a later `close` (the default);
                ``False`` lets the server end the session now.
            body: Extra fields for the server's verifier.
        """
        headers = {"x-gym-close-follows": "1"} if close_follows else {}
        return self._http.request("POST", "/verify", body, headers=headers)

    def close(self) -> None:
        """Close the session on the server (once) and the connection."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._started:
                self._http.request(
                    "POST", "/close_session", {"resources_session_id": self.session_id}
                )
        finally:
            self._http.close()
