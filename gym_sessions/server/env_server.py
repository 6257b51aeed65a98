"""The Gymnasium adapter: one env instance per session behind the resources-server routes.

``/reset`` and ``/seed_session`` start a session (a reset of an open session
starts a new episode on the same instance, a seed of one returns it as it is;
a start body's ``render_mode``
makes the session's env with that mode), ``/step`` is the tool call,
``/render`` replies the session's frame as raw bytes
(`gym_sessions.frames`), ``/verify`` scores the episode (the env's own
``verify()`` when it has one, else the episode return) and ``/close_session``
calls ``env.close()`` once. Observations and actions travel as JSON, or as
binary messages to a client that asks (``GET /spaces`` offers them;
`gym_sessions.value_messages`): the adapter keeps an observation as the
native value (`SpaceValue`) and each reply encodes it as its request asked.

With durable sessions a session is captured (`env_capture_method`) by the
env's own ``get_state()`` / ``set_state(state)`` when the env the factory
returns defines both, else by pickling the env (wrappers and ``np_random``
included), together with the episode's bookkeeping (docs/design.md §3.14.1).
"""

from __future__ import annotations

import copy
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium as gym
from gymnasium.utils import seeding
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gym_sessions.errors import (
    EnvError,
    InvalidRequestError,
    NoOpenEpisodeError,
    StepOutOfOrderError,
    exception_text,
)
from gym_sessions.frames import encode_frame
from gym_sessions.routing.step_batch import MAX_BATCH_ENTRIES, STEP_BATCH_PATH, BatchSteps
from gym_sessions.server.bodies import BodySchema, Field, read_json
from gym_sessions.server.resources import ResourcesServer, session_id
from gym_sessions.server.tools import Tool
from gym_sessions.spaces import (
    SpaceCodecError,
    space_json_schema,
    space_to_json,
    value_from_json,
)
from gym_sessions.spaces.binary import value_from_tree
from gym_sessions.spaces.values import space_contains, to_jsonable
from gym_sessions.value_messages import OFFER_FIELD, BinaryValue, SpaceValue, binary_offer
from gym_sessions.wire import EPISODE_LENGTH_HEADER, PYTHON_INT_FIELD

__all__ = ["GymEnvServer", "env_capture_method", "to_jsonable"]

logger = logging.getLogger("gym_sessions.server")

CaptureMethod = Literal["get_state", "pickle"]
# Bumped when the snapshot payload of an env session changes shape
# (2: the observation and the start record's are native values, not JSON).
_SNAPSHOT_VERSION = 2

EnvFactory = Callable[..., gym.Env]
_MAX_SEED = 2**64
_RENDER_BODY = BodySchema()


@dataclass
class _ServedEnv:
    """The env a session is served from and its open episode's bookkeeping.

    (Not to be confused with `gym_sessions.server.env_session.EnvSession`, an
    agent's HTTP handle on a session of some env server.)
    """

    env: gym.Env
    render_mode: str | None = None
    episode_open: bool = False
    episode_return: float = 0.0
    episode_length: int = 0
    observation: SpaceValue | None = None  # the latest observation


def _defines_state_protocol(env: gym.Env) -> bool:
    return callable(getattr(type(env), "get_state", None)) and callable(
        getattr(type(env), "set_state", None)
    )


def env_capture_method(env: gym.Env) -> CaptureMethod | None:
    """How a session of ``env`` would be captured for durable sessions, or ``None`` if it cannot.

    ``"get_state"``: the env (the object the factory returns, not an inner one
    behind wrappers) defines ``get_state() -> bytes`` and ``set_state(bytes)``.
    ``"pickle"``: ``pickle`` round-trips it. Check an env with::

        python -c "import gymnasium as gym; from gym_sessions.server import env_capture_method; \
                   print(env_capture_method(gym.make('CartPole-v1')))"
    """
    if _defines_state_protocol(env):
        return "get_state"
    try:
        pickle.loads(pickle.dumps(env))
    except Exception:
        return None
    return "pickle"


def _rng_state(env: gym.Env) -> Any:
    # Gymnasium's Env keeps its generator in `_np_random` (None until first used).
    rng = getattr(env.unwrapped, "_np_random", None)
    if rng is None:
        return None
    return {
        "bit_generator": rng.bit_generator.state,
        "seed": getattr(env.unwrapped, "_np_random_seed", None),
    }


def _set_rng_state(env: gym.Env, state: Any) -> None:
    if state is None:
        return
    rng, _ = seeding.np_random(0)  # the generator type Gymnasium uses, then its state
    rng.bit_generator.state = state["bit_generator"]
    env.unwrapped._np_random = rng
    env.unwrapped._np_random_seed = state["seed"]


def _call_env(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        raise EnvError(f"env.{what} raised {exception_text(exc)}") from exc


class GymEnvServer(ResourcesServer):
    """Serves a Gymnasium environment, one instance per session.

    Args:
        env_factory: Called once per session (an ``Env`` subclass, a factory, or
            ``functools.partial(gymnasium.make, id)``): with no arguments, or
            with ``render_mode=`` when the session start asks for one.
        name: Shown by ``/spaces`` when the env has no spec.
    """

    def __init__(self, env_factory: EnvFactory, name: str = "env") -> None:
        self.env_factory = env_factory
        self.name = name
        probe = env_factory()
        if not isinstance(probe, gym.Env):
            raise TypeError(f"the factory returned {type(probe).__name__}, not a gymnasium.Env")
        try:
            self.render_modes = list(probe.metadata.get("render_modes") or [])
            self.observation_space = probe.observation_space
            self.action_space = probe.action_space
            self._spaces_reply = {
                "observation_space": space_to_json(probe.observation_space),
                "action_space": space_to_json(probe.action_space),
                "metadata": to_jsonable(dict(probe.metadata)),
                "spec": _spec_json(probe, name),
                # Clients step many sessions in one request where this is offered.
                "step_batch": {"path": STEP_BATCH_PATH, "max_entries": MAX_BATCH_ENTRIES},
                # ... and send values in binary (docs/design.md §3.15).
                OFFER_FIELD: binary_offer(),
            }
        finally:
            probe.close()
        self.step_arguments = BodySchema(
            {
                "action": Field(
                    required=True,
                    description="an element of the action space",
                    schema=space_json_schema(self.action_space),
                )
            }
        )
        self._sessions: dict[str, _ServedEnv] = {}

    def durability(self) -> str | None:
        probe = self.env_factory()
        try:
            method = env_capture_method(probe)
        finally:
            probe.close()
        return None if method is None else f"{self.name}: captured by {method}"

    def export_session(self, session_id: str) -> bytes | None:
        state = self._sessions.get(session_id)
        if state is None:
            return None
        payload: dict[str, Any] = {
            "version": _SNAPSHOT_VERSION,
            "render_mode": state.render_mode,
            "episode_open": state.episode_open,
            "episode_return": state.episode_return,
            "episode_length": state.episode_length,
            "observation": None if state.observation is None else state.observation.value,
            "records": self.session_records(session_id),
        }
        if _defines_state_protocol(state.env):
            env_state = state.env.get_state()  # type: ignore[attr-defined]
            if not isinstance(env_state, bytes):
                raise TypeError(f"get_state() returned {type(env_state).__name__}, not bytes")
            payload["env_state"] = env_state
            payload["rng"] = _rng_state(state.env)
        else:
            try:
                payload["env"] = pickle.dumps(state.env)
            except Exception as exc:
                logger.debug("session %r: its env does not pickle: %r", session_id, exc)
                return None
        return pickle.dumps(payload)

    def import_session(self, session_id: str, data: bytes) -> None:
        # Only bytes whose MAC verified reach here (`SnapshotCodec.decode`).
        payload = pickle.loads(data)
        if payload.get("version") != _SNAPSHOT_VERSION:
            raise ValueError(f"snapshot version {payload.get('version')!r} is not supported")
        render_mode = payload["render_mode"]
        if "env_state" in payload:
            env = self._new_env(render_mode)
            env.set_state(payload["env_state"])  # type: ignore[attr-defined]
            _set_rng_state(env, payload["rng"])
        else:
            env = pickle.loads(payload["env"])
        stale = self._sessions.pop(session_id, None)
        if stale is not None:
            # Left by a request this worker served without the claim: never two envs.
            stale.env.close()
        observation = payload["observation"]
        self._sessions[session_id] = _ServedEnv(
            env,
            render_mode,
            episode_open=payload["episode_open"],
            episode_return=payload["episode_return"],
            episode_length=payload["episode_length"],
            observation=None
            if observation is None
            else SpaceValue(self.observation_space, observation),
        )
        self.restore_records(session_id, payload.get("records", {}))

    def metrics(self) -> dict[str, Any]:
        return {"sessions": len(self._sessions)}

    def extra_routes(self) -> list[BaseRoute]:
        return [
            Route("/spaces", self._spaces_route, methods=["GET"]),
            Route("/render", self._render_route, methods=["POST"]),
        ]

    def tools(self) -> list[Tool]:
        return [
            Tool(
                "step",
                "Take one action in this session's episode; returns observation, reward, "
                "terminated, truncated and info.",
                self.step_arguments,
                self._step,
                carries_values=True,
            ),
            Tool(
                "observe",
                "Read the latest observation of this session's episode without acting.",
                BodySchema(),
                self._observe,
                carries_values=True,
            ),
        ]

    async def _spaces_route(self, request: Request) -> JSONResponse:
        return JSONResponse(self._spaces_reply)

    async def _render_route(self, request: Request) -> Response:
        _RENDER_BODY.validate(await read_json(request))
        sid = session_id(request)
        self.refuse_if_closed(sid)
        state = self._sessions.get(sid)
        if state is None:
            raise NoOpenEpisodeError("this session has no environment to render: call /reset")
        frame = _call_env("render", state.env.render)
        try:
            encoded = encode_frame(frame)
        except TypeError as exc:
            raise EnvError(
                f"env.render returned a frame that cannot be sent: {exception_text(exc)}"
            ) from exc
        return Response(
            encoded.body, encoded.status, encoded.headers, media_type=encoded.media_type
        )

    def _new_env(self, render_mode: Any) -> gym.Env:
        if render_mode is None:
            return _call_env("__init__", self.env_factory)
        # As gymnasium.make: an env that declares no render modes is asked for any.
        declared = not self.render_modes or render_mode in self.render_modes
        if not isinstance(render_mode, str) or not declared:
            raise InvalidRequestError(
                f"render_mode must be one of the env's render modes {self.render_modes}, "
                f"not {render_mode!r}"
            )
        return _call_env("__init__", self.env_factory, render_mode=render_mode)

    async def start_session(self, session_id: str, body: dict[str, Any], path: str) -> dict:
        seed, options = body.get("seed"), body.get("options")
        if seed is not None and not 0 <= seed < _MAX_SEED:
            raise InvalidRequestError("seed must be an integer in [0, 2**64)")
        render_mode = body.get("render_mode")
        self.session_changed(session_id)
        state = self._sessions.get(session_id)
        if state is None:
            state = _ServedEnv(self._new_env(render_mode), render_mode)
            self._sessions[session_id] = state
        elif render_mode is not None and render_mode != state.render_mode:
            # The env instance outlives the episode; its render mode is fixed.
            raise InvalidRequestError(
                f"this session's env renders in mode {state.render_mode!r}, not {render_mode!r}"
            )
        state.episode_open = False
        observation, info = _call_env("reset", state.env.reset, seed=seed, options=options)
        state.episode_open = True
        state.episode_return, state.episode_length = 0.0, 0
        # A copy: the start's reply is kept (a repeated seed gets it again) while
        # the env may reuse the array it returned.
        state.observation = SpaceValue(self.observation_space, copy.deepcopy(observation))
        return {
            "observation": state.observation,
            "info": to_jsonable(info),
            **python_int_marker(self.observation_space, observation),
        }

    def _open_episode(self, request: Request) -> _ServedEnv:
        return self._open_episode_of(session_id(request))

    def _open_episode_of(self, sid: str) -> _ServedEnv:
        state = self._sessions.get(sid)
        if state is None or not state.episode_open:
            raise NoOpenEpisodeError(
                "this session has no open episode: call /reset first"
                if state is None
                else "the episode has ended: call /reset to start a new one"
            )
        return state

    async def _observe(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        state = self._open_episode(request)
        return {"observation": state.observation, "episode_length": state.episode_length}

    async def _step(self, request: Request, body: dict[str, Any]) -> dict[str, Any]:
        # One scan of the raw headers: a Starlette Headers object per step costs more.
        at_length = next(
            (value for name, value in request.scope["headers"] if name == _EPISODE_LENGTH), None
        )
        return self._step_served(
            session_id(request), body["action"], None if at_length is None else _length(at_length)
        )

    def batch_steps(self) -> BatchSteps:
        return self

    async def step_session(
        self, session_id: str, action: Any, at_length: int | None = None
    ) -> dict[str, Any]:
        """A ``/step_batch`` entry: ``/step`` of ``session_id``, closed sessions refused first."""
        self.refuse_if_closed(session_id)
        return self._step_served(session_id, action, at_length)

    def _step_served(
        self, sid: str, encoded_action: Any, at_length: int | None = None
    ) -> dict[str, Any]:
        state = self._open_episode_of(sid)
        if at_length is not None and at_length != state.episode_length:
            raise StepOutOfOrderError(
                f"this step was sent at episode length {at_length}, but the episode is at"
                f" {state.episode_length}: it did not run (an earlier send of it ran first?)"
            )
        try:
            if isinstance(encoded_action, BinaryValue):
                # One copy, so the env gets writable arrays (as from JSON, or locally).
                buffers = [memoryview(bytearray(buffer)) for buffer in encoded_action.buffers]
                action = value_from_tree(self.action_space, encoded_action.tree, buffers)
            else:
                action = value_from_json(self.action_space, encoded_action)
        except SpaceCodecError as exc:
            raise InvalidRequestError(f"action does not fit the action space: {exc}") from exc
        if not space_contains(self.action_space, action):
            if isinstance(encoded_action, BinaryValue):
                raise InvalidRequestError(f"action {action!r:.200} is outside the action space")
            raise InvalidRequestError(f"action {encoded_action!r} is outside the action space")
        # Before the step: a step that raises may still have changed the env.
        self.session_changed(sid)
        observation, reward, terminated, truncated, info = _call_env("step", state.env.step, action)
        reward = float(reward)
        state.episode_return += reward
        state.episode_length += 1
        if terminated or truncated:
            state.episode_open = False
        state.observation = SpaceValue(self.observation_space, observation)
        return {
            "observation": state.observation,
            "reward": reward,
            "terminated": bool(terminated),
            "truncated": bool(truncated),
            "info": to_jsonable(info),
            **python_int_marker(self.observation_space, observation),
        }

    async def verify_session(self, session_id: str, body: dict[str, Any]) -> dict:
        state = self._sessions.get(session_id)
        if state is None:
            raise NoOpenEpisodeError("this session has no environment to verify: call /reset")
        summary = {"episode_return": state.episode_return, "episode_length": state.episode_length}
        verify = getattr(state.env.unwrapped, "verify", None)
        if verify is None:
            return {"reward": state.episode_return, **summary}
        result = _call_env("verify", verify)
        if isinstance(result, dict):
            return {**summary, **to_jsonable(result)}
        return {"reward": float(result), **summary}

    def release_session(self, session_id: str) -> None:
        self.session_changed(session_id)
        state = self._sessions.get(session_id)
        if state is not None:
            state.env.close()
            # Dropped only once closed: a close that raised is tried again by the
            # session's next close (or when its claim ends).
            self._sessions.pop(session_id, None)

    def release_all(self) -> None:
        for sid in list(self._sessions):
            try:
                self.release_session(sid)
            except Exception:
                continue


_EPISODE_LENGTH = EPISODE_LENGTH_HEADER.encode()


def _length(header: bytes) -> int:
    """The episode length an ``x-gym-episode-length`` header names."""
    if not header.isdigit() or len(header) > 18:
        raise InvalidRequestError(
            f"{EPISODE_LENGTH_HEADER} must be the episode's length, a non-negative integer"
        )
    return int(header)


def python_int_marker(space: gym.Space[Any], observation: Any) -> dict[str, Any]:
    """``{"observation_python_int": True}`` when a Discrete observation is a Python ``int``.

    JSON carries a Discrete value as a number either way and the client
    decodes it as a numpy integer; the marker lets it give back the ``int``
    the served env returned (as a local ``SyncVectorEnv``'s ``final_obs`` holds it).
    """
    if type(observation) is int and isinstance(space, gym.spaces.Discrete):
        return {PYTHON_INT_FIELD: True}
    return {}


def _spec_json(env: gym.Env, name: str) -> dict[str, Any]:
    spec = env.spec
    if spec is None:
        return {"id": name, "max_episode_steps": None, "reward_threshold": None}
    return {
        "id": spec.id,
        "max_episode_steps": spec.max_episode_steps,
        "reward_threshold": spec.reward_threshold,
        "nondeterministic": spec.nondeterministic,
    }
