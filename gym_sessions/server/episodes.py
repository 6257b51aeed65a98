"""NeMo Gym's typed session fields, and the reply shapes a request carrying them gets.

NeMo Gym's environment servers seed and close resources and agent sessions
under ids they assign, with typed fields beside the id: ``episode_id`` (which
physical attempt of which rollout), ``task_id`` and ``task_data`` on seeds, and
on agent seeds ``tool_accesses`` and ``sandbox_access``. Their reply models
refuse unknown fields, so a request that carries ``episode_id`` is answered in
NeMo's shape: the id (and, on resources seeds, the MCP access as
``resources_tools``), without this project's own fields (``observation``,
``created``, ``outcome``). A request without ``episode_id`` keeps the native
reply. docs/design.md §3.2 and §3.6 list both.

An ``episode_id`` binds the session: a close naming another episode is 409
``session_conflict``, as NeMo refuses it.
"""

from __future__ import annotations

from typing import Any

from gym_sessions.errors import InvalidRequestError, SessionConflictError
from gym_sessions.server.bodies import Field

__all__ = [
    "AGENT_SEED_FIELDS",
    "CLOSE_FIELDS",
    "EPISODE_ID_FIELD",
    "SEED_FIELDS",
    "EpisodeBinding",
    "episode_of",
]

EPISODE_ID_FIELD = "episode_id"

_EPISODE_ID = Field(
    ("object", "null"),
    description="NeMo Gym's episode: {rollout_id, attempt?}; binds the session to it",
)
#: Fields of NeMo's resources seed, beside ``resources_session_id``.
SEED_FIELDS = {
    EPISODE_ID_FIELD: _EPISODE_ID,
    "task_id": Field(("object", "null"), description="NeMo Gym's task: {taskset, task_id}"),
    "task_data": Field(("object", "null"), description="the task's data, for the start hook"),
}
#: Fields of NeMo's agent seed, beside ``agent_session_id``.
AGENT_SEED_FIELDS = {
    EPISODE_ID_FIELD: _EPISODE_ID,
    "task_id": SEED_FIELDS["task_id"],
    "tool_accesses": Field(("array", "null"), description="tools the agent may use"),
    "sandbox_access": Field(("object", "null"), description="a sandbox the agent may use"),
}
#: Fields of NeMo's closes (resources and agent), beside the id.
CLOSE_FIELDS = {EPISODE_ID_FIELD: _EPISODE_ID}


def episode_of(body: dict[str, Any]) -> tuple[str, int] | None:
    """The ``episode_id`` a body carries as ``(rollout_id, attempt)``, or ``None``.

    Raises:
        InvalidRequestError: ``episode_id`` is not ``{rollout_id: non-empty
            string, attempt?: integer >= 0}``.
    """
    value = body.get(EPISODE_ID_FIELD)
    if value is None:
        return None
    assert isinstance(value, dict)  # the route's body schema checked the type
    unknown = sorted(set(value) - {"rollout_id", "attempt"})
    rollout, attempt = value.get("rollout_id"), value.get("attempt", 0)
    if (
        unknown
        or not isinstance(rollout, str)
        or not rollout
        or isinstance(attempt, bool)
        or not isinstance(attempt, int)
        or attempt < 0
    ):
        raise InvalidRequestError(
            "episode_id must be {rollout_id: a non-empty string, attempt: an integer >= 0}"
        )
    return rollout, attempt


class EpisodeBinding:
    """The episode each session id was seeded (or first closed) for, while its records last."""

    def __init__(self) -> None:
        self._episodes: dict[str, tuple[str, int]] = {}

    def bind(self, session_id: str, episode: tuple[str, int] | None) -> None:
        """Bind ``session_id`` to ``episode`` unless it is bound already (or there is none)."""
        if episode is not None:
            self._episodes.setdefault(session_id, episode)

    def check(self, session_id: str, episode: tuple[str, int] | None) -> None:
        """Refuse a request naming another episode than the bound one (409).

        A request naming no episode (a native client) is not checked.
        """
        bound = self._episodes.get(session_id)
        if episode is not None and bound is not None and bound != episode:
            raise SessionConflictError(
                f"session {session_id!r} belongs to episode {_describe(bound)}, "
                f"not {_describe(episode)}"
            )

    def of(self, session_id: str) -> tuple[str, int] | None:
        """The episode ``session_id`` is bound to, if any."""
        return self._episodes.get(session_id)

    def forget(self, session_id: str) -> None:
        """Drop the binding (the session's last record is gone)."""
        self._episodes.pop(session_id, None)

    def clear(self) -> None:
        self._episodes.clear()


def _describe(episode: tuple[str, int]) -> str:
    return f"{episode[0]!r} attempt {episode[1]}"
