"""What a remote env session sends and what the replies mean, without any I/O.

`RemoteEnv` (blocking) and `AsyncRemoteEnv` (``await``) are two thin shells
around one `RemoteEnvProtocol`: it builds every request (route, JSON body,
whether it is safe to send again) and decodes every reply (observations through
the space codec, frames through `gym_sessions.frames`), so the two
clients cannot drift apart. The shells only move bytes. The agent's env
sessions (`gym_sessions.server.env_session`) build their requests with the same
functions (`start_request`, `verify_request`, `close_request`, ...).

Which requests may be sent again after a lost reply (`Request.resendable`):

- ``GET`` requests, ``/render``, ``/observe`` and ``/close_session`` change nothing
  or are idempotent;
- ``/reset`` carries the session id the client picked (``resources_session_id``)
  and a random ``session_key`` it keeps for the session, so a resent start (whose
  first reply, and so the cookie, was lost) restarts the episode of the same
  session and never creates a second one; a close carries the key too;
- ``/step`` and ``/verify`` are not idempotent and are never resent blindly.
  After a lost ``/step`` reply the client asks ``/observe`` how many steps the
  episode has taken: if the step did not run it is sent again, otherwise
  `ConnectionLostError` says the step ran and its reply is lost
  (`gym_sessions.client.step_recovery`).

Observations and actions travel in the binary encoding whenever ``GET /spaces``
offers it (`gym_sessions.value_messages`; docs/design.md §3.15), JSON
otherwise (an older server): the client asks for binary replies in ``Accept``
and sends binary step bodies; it reads each reply by its own ``Content-Type``.
Arrays of a binary reply are decoded from one copy of its body, so they are
writable as a local env's are.

A session is closed at most once (`claim_close`), whether by ``close()`` or by
the close at garbage collection or exit (`gym_sessions.client.lifecycle`). A
reset after a close starts a new session (`new_session`): a new id and a new
key, since the server refuses a closed id for its window (409 session_closed).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from gym_sessions.client.exchange import EncodedBody, Reply, Request
from gym_sessions.client.step_recovery import StepRecovery
from gym_sessions.errors import InvalidBinaryError
from gym_sessions.frames import decode_frame
from gym_sessions.spaces import space_from_json, value_from_json, value_to_json
from gym_sessions.spaces.binary import value_from_tree, value_to_tree
from gym_sessions.value_messages import (
    BATCH_BODY,
    BATCH_REPLY,
    BINARY_ACCEPT,
    BINARY_MEDIA_TYPE,
    STEP_BODY,
    VALUE_REPLY,
    BinaryValue,
    Encoding,
    ValuePositions,
    body_encoding,
    decode_message,
    encode_message,
    offers_binary,
)
from gym_sessions.wire import CLOSE_FOLLOWS_HEADER, EPISODE_LENGTH_HEADER, PYTHON_INT_FIELD

__all__ = [
    "HEALTH_REQUEST",
    "LIST_SUFFIX",
    "SPACES_REQUEST",
    "WIRE_RENDER_MODES",
    "EnvDescription",
    "RemoteEnvProtocol",
    "Reply",
    "Request",
    "batch_request",
    "batch_results",
    "close_request",
    "reply_fields",
    "session_names",
    "start_request",
    "step_request",
    "verify_request",
]

#: Render modes whose frames a client can receive. ``human`` would open a window
#: on the server's machine; ``gymnasium.make(..., render_mode="human")`` shows the
#: ``rgb_array`` frames locally instead (and ``*_list`` modes collect them locally).
WIRE_RENDER_MODES = ("rgb_array", "depth_array", "ansi")

#: A render mode ending so (``rgb_array_list``) collects its base mode's frames on the client.
LIST_SUFFIX = "_list"


SPACES_REQUEST = Request("GET", "/spaces", resendable=True)
# Sent with the session cookie: the router hands it to the worker that claims
# the session, whichever worker accepted the connection.
HEALTH_REQUEST = Request("GET", "/health", resendable=True)
RENDER_REQUEST = Request("POST", "/render", {}, resendable=True)


# The routes of a session, as JSON ------------------------------------------------------------


def session_names(session_id: str, session_key: str) -> dict[str, str]:
    """The body fields that name a session and prove its ownership without the cookie."""
    return {"resources_session_id": session_id, "session_key": session_key}


#: ``Accept`` of the requests whose replies carry observations, once binary is offered.
_BINARY_REPLIES = {"Accept": BINARY_ACCEPT}


def start_request(
    route: str,
    names: Mapping[str, str],
    body: Mapping[str, Any],
    *,
    first: bool,
    binary: bool = False,
) -> Request:
    """A session start (``/reset``, ``/seed_session``) by id and key, so resendable.

    Args:
        route: The start route.
        names: `session_names` of the session.
        body: The route's other fields (seed, options, ...).
        first: The session's first start (drops an earlier session's cookie).
        binary: Ask for the observation in binary.
    """
    headers = _BINARY_REPLIES if binary else {}
    return Request("POST", route, {**names, **body}, headers, resendable=True, new_session=first)


def step_request(action: Any, episode_length: int) -> Request:
    """One ``/step`` with an action already encoded; never resent blindly.

    ``action`` in JSON, or a `BinaryValue`: then the body is a binary message and
    the reply is asked for in binary. It runs only at ``episode_length`` (the
    steps before it, as the client counts them): a resend after a lost reply
    cannot run the step twice.
    """
    length = str(episode_length)
    if isinstance(action, BinaryValue):
        body = EncodedBody(encode_message({"action": action}, STEP_BODY), BINARY_MEDIA_TYPE)
        return Request("POST", "/step", body, {EPISODE_LENGTH_HEADER: length, **_BINARY_REPLIES})
    return Request("POST", "/step", {"action": action}, {EPISODE_LENGTH_HEADER: length})


def batch_request(path: str, entries: list[dict[str, Any]]) -> Request:
    """A ``/step_batch`` of ``entries`` (their actions JSON, or all `BinaryValue`: binary)."""
    batch = {"entries": entries}
    if entries and isinstance(entries[0]["action"], BinaryValue):
        body = EncodedBody(encode_message(batch, BATCH_BODY), BINARY_MEDIA_TYPE)
        return Request("POST", path, body, _BINARY_REPLIES, sends_cookie=False)
    return Request("POST", path, batch, sends_cookie=False)


def reply_fields(reply: Reply, positions: ValuePositions = VALUE_REPLY) -> Any:
    """A reply's JSON, or its binary message's head with a `BinaryValue` at each value position.

    Read by the reply's own ``Content-Type``; a binary body is copied once, so
    the arrays decoded from its values are writable.

    Raises:
        ValueError: the body is not what its ``Content-Type`` says.
    """
    if body_encoding(reply.headers.get("content-type")) is Encoding.JSON:
        return reply.json()
    try:
        return decode_message(bytearray(reply.body), positions)
    except InvalidBinaryError as exc:  # the server's fault: no request error
        raise ValueError(f"malformed binary reply: {exc.message}") from exc


def batch_results(reply: Reply) -> Any:
    """The per-entry results of a ``/step_batch`` reply (JSON or binary)."""
    return reply_fields(reply, BATCH_REPLY)["results"]


def verify_request(close_follows: bool, body: Mapping[str, Any]) -> Request:
    """``/verify``; ``close_follows`` keeps the session open for the close that follows."""
    headers = {CLOSE_FOLLOWS_HEADER: "1"} if close_follows else {}
    return Request("POST", "/verify", dict(body), headers)


def close_request(names: Mapping[str, str]) -> Request:
    """``/close_session`` by body id and key: reaches the session even without its cookie."""
    return Request("POST", "/close_session", dict(names), resendable=True)


# A remote Gymnasium env ----------------------------------------------------------------------


@dataclass(frozen=True)
class EnvDescription:
    """A served env as ``GET /spaces`` describes it.

    Attributes:
        observation_space: The env's observation space.
        action_space: The env's action space.
        metadata: The env's metadata; ``render_modes`` keeps only the modes a
            client can receive (`WIRE_RENDER_MODES`).
        spec: The server's spec summary (``id``, ``max_episode_steps``,
            ``reward_threshold``, ``nondeterministic``; `local_spec` puts them
            on the client's ``env.spec``).
        step_batch: The server's step batch route (``{"path", "max_entries"}``),
            or ``None`` when it offers none (an older server).
        binary_values: The server offers the binary encoding of values
            (`gym_sessions.value_messages`); the clients then use it.
    """

    observation_space: gym.Space[Any]
    action_space: gym.Space[Any]
    metadata: dict[str, Any]
    spec: dict[str, Any]
    step_batch: dict[str, Any] | None = None
    #: The served env declares no render modes (so, as ``gymnasium.make``, any mode is tried).
    render_modes_undeclared: bool = False
    binary_values: bool = False

    @classmethod
    def from_json(cls, reply: Mapping[str, Any]) -> EnvDescription:
        metadata = dict(reply.get("metadata") or {})
        served = metadata.get("render_modes") or []
        metadata["render_modes"] = [mode for mode in served if mode in WIRE_RENDER_MODES]
        return cls(
            space_from_json(reply["observation_space"]),
            space_from_json(reply["action_space"]),
            metadata,
            dict(reply.get("spec") or {}),
            _step_batch(reply.get("step_batch")),
            render_modes_undeclared=not served,
            binary_values=offers_binary(reply),
        )

    def local_spec(self, spec: EnvSpec | None) -> EnvSpec | None:
        """``spec`` (the client's, from ``gymnasium.make``) with the served env's episode limits.

        The served env's ``max_episode_steps`` and ``reward_threshold`` fill
        the ones ``spec`` leaves unset, so wrappers that read them
        (``TimeAwareObservation``, say) see the served env's. The served env
        truncates its episodes itself; a ``TimeLimit`` that ``gymnasium.make``
        builds from this spec again cuts at the same step.
        """
        if spec is None:
            return None
        limits = {
            field: self.spec[field]
            for field in ("max_episode_steps", "reward_threshold")
            if getattr(spec, field) is None and self.spec.get(field) is not None
        }
        return dataclasses.replace(spec, **limits) if limits else spec

    def check_render_mode(self, render_mode: str | None) -> None:
        """Raise `ValueError` unless ``render_mode`` is ``None`` or one this env offers.

        A served env that declares no render modes may be asked for any mode
        that travels over HTTP, as ``gymnasium.make`` passes any mode to an env
        that declares none.
        """
        modes = self.metadata["render_modes"]
        if self.render_modes_undeclared:
            modes = list(WIRE_RENDER_MODES)
        if render_mode is not None and render_mode not in modes:
            hint = (
                " (for a window, make the env with render_mode='human': gymnasium.make shows "
                "the rgb_array frames locally)"
                if render_mode == "human"
                else ""
            )
            raise ValueError(
                f"render_mode {render_mode!r} is not one of the served env's modes {modes}{hint}"
            )


def _step_batch(offer: Any) -> dict[str, Any] | None:
    """The ``/spaces`` batch offer, if it is one this client can use."""
    if (
        isinstance(offer, dict)
        and isinstance(offer.get("path"), str)
        and isinstance(offer.get("max_entries"), int)
        and offer["max_entries"] > 0
    ):
        return {"path": offer["path"], "max_entries": offer["max_entries"]}
    return None


class RemoteEnvProtocol:
    """Requests and replies of one env session, without I/O.

    Args:
        description: The served env.
        render_mode: Render mode for the session's env (checked against the description).
        session_id: The first session's id; a fresh random one by default.
    """

    def __init__(
        self,
        description: EnvDescription,
        render_mode: str | None = None,
        session_id: str | None = None,
    ) -> None:
        description.check_render_mode(render_mode)
        self.description = description
        self.render_mode = render_mode
        # A close at garbage collection may run on another thread than close().
        self._close_lock = threading.Lock()
        self.new_session(session_id)

    def new_session(self, session_id: str | None = None) -> None:
        """Name a new session: a new id (random by default) and a new key, not yet started."""
        self.session_id = session_id or uuid.uuid4().hex
        #: Proof of ownership for starts and closes sent without the cookie.
        self.session_key = secrets.token_urlsafe(32)
        #: A start was sent: the server may hold the session (even if its reply was lost).
        self.started = False
        #: Set by `claim_close`: the session is closed or being closed.
        self.closed = False
        #: Steps of the open episode, as the server counts them (``/observe``).
        self.episode_length = 0
        #: The server worker holding the session (`health_reply`).
        self.worker: str | None = None

    # Session start and steps -------------------------------------------------------------

    def reset_request(self, seed: int | None, options: dict[str, Any] | None) -> Request:
        """The start of an episode; after a close, of a new session (as a local env allows)."""
        if self.closed:
            self.new_session()  # the server refuses a closed id for its window
        first_start = not self.started
        self.started = True
        body: dict[str, Any] = {"seed": seed, "options": options}
        if self.render_mode is not None:
            body["render_mode"] = self.render_mode
        names = session_names(self.session_id, self.session_key)
        binary = self.description.binary_values
        return start_request("/reset", names, body, first=first_start, binary=binary)

    def reset_reply(self, reply: Reply) -> tuple[Any, dict[str, Any]]:
        data = reply_fields(reply)
        self.episode_length = 0
        return self._observation(data), data["info"]

    def _observation(self, data: Mapping[str, Any]) -> Any:
        """A reply's observation, decoded; a Python ``int`` where the served env gave one."""
        space, raw = self.description.observation_space, data["observation"]
        if isinstance(raw, BinaryValue):
            observation = value_from_tree(space, raw.tree, raw.buffers)
        else:
            observation = value_from_json(space, raw)
        if data.get(PYTHON_INT_FIELD) is True:
            return int(observation)
        return observation

    def encode_action(self, action: Any) -> Any:
        """``action`` as the server takes it: a `BinaryValue` where binary is offered, else JSON."""
        space = self.description.action_space
        if self.description.binary_values:
            return BinaryValue(*value_to_tree(space, action))
        return value_to_json(space, action)

    def step_recovery(self, action: Any) -> StepRecovery:
        """The requests of a step of ``action``, a lost reply included."""
        encoded = self.encode_action(action)
        return StepRecovery(
            step_request(encoded, self.episode_length), self.episode_length, self._step_ran
        )

    def _step_ran(self) -> None:
        # A step that ran with its reply lost still counts: the next one is sent
        # at the length the server has (x-gym-episode-length).
        self.episode_length += 1

    def step_reply(self, reply: Reply) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        return self.step_result(reply_fields(reply))

    def step_result(self, data: Mapping[str, Any]) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        """A ``/step`` reply's (or ``/step_batch`` entry's) fields as Gymnasium's tuple."""
        self.episode_length += 1
        return (
            self._observation(data),
            data["reward"],
            data["terminated"],
            data["truncated"],
            data["info"],
        )

    # Other routes ---------------------------------------------------------------------------

    def render_request(self) -> Request:
        return RENDER_REQUEST

    def render_reply(self, reply: Reply) -> Any:
        return decode_frame(reply.status, reply.headers, reply.body)

    def verify_request(self, close_follows: bool, body: dict[str, Any]) -> Request:
        return verify_request(close_follows, body)

    def health_request(self) -> Request:
        return HEALTH_REQUEST

    def health_reply(self, reply: Reply) -> str:
        """Remember and return the worker that holds the session."""
        self.worker = reply.json()["worker"]
        return self.worker

    # Closing -------------------------------------------------------------------------------

    def close_request(self) -> Request:
        return close_request(session_names(self.session_id, self.session_key))

    def claim_close(self) -> Request | None:
        """Mark the session closed; returns its close request the first time, if it started.

        ``close()`` and the close at garbage collection or exit both ask here,
        so a session is never closed twice (and a never-started one never is).
        """
        with self._close_lock:
            if self.closed:
                return None
            self.closed = True
        return self.close_request() if self.started else None
