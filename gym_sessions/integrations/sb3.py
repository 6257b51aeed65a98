"""Stable-Baselines3 on remote envs: `RemoteVecEnv`, an SB3 ``VecEnv`` of remote sessions.

`RemoteVecEnv` drives one `RemoteVectorEnv` (``num_envs`` sessions stepped
concurrently from one event loop) and speaks SB3's ``VecEnv`` API on top of it,
with the semantics of SB3's ``DummyVecEnv``:

- ``reset()`` passes the seeds of ``seed()`` and the options of
  ``set_options()`` to the remote envs, once, as ``DummyVecEnv`` does (sub-env
  ``i`` gets ``seed + i``); ``reset_infos`` holds each sub-env's reset info.
- ``step_wait()`` returns observations, float32 rewards, dones and a list of
  info dicts. A sub-env whose episode ended is reset within the same step (the
  vector env runs in Gymnasium's ``SAME_STEP`` autoreset mode): its observation
  is the new episode's first, its info holds ``terminal_observation`` and
  ``TimeLimit.truncated`` (truncated and not terminated), and ``reset_infos[i]``
  the new episode's reset info.
- ``render()`` tiles the sub-envs' ``rgb_array`` frames (SB3's ``VecEnv.render``
  over `get_images`); ``close()`` closes every remote session.

The remote envs' own attributes and methods live on the server, so
``get_attr``, ``set_attr``, ``env_method`` and ``env_is_wrapped`` reach the
local `AsyncRemoteEnv` proxies: see each method for what they do.

Needs the ``sb3`` extra: ``pip install 'gym-sessions[sb3]'``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from gymnasium import Wrapper, spaces
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import concatenate, create_empty_array

from gym_sessions.client.vector_env import RemoteVectorEnv, sub_env_info

try:
    from stable_baselines3.common.vec_env.base_vec_env import (
        VecEnv,
        VecEnvIndices,
        VecEnvObs,
        VecEnvStepReturn,
    )
except ImportError as exc:  # the optional extra is missing
    raise ImportError(
        "gym_sessions.integrations.sb3 needs Stable-Baselines3, which is not installed: "
        "pip install 'gym-sessions[sb3]'"
    ) from exc

__all__ = ["RemoteVecEnv"]

#: Sub-env methods `RemoteVecEnv.env_method` calls: the ones that leave the
#: sub-env in step with the VecEnv (a reset, step or close behind its back would not).
ENV_METHODS = ("render", "verify")

#: Sub-env attributes `RemoteVecEnv.get_attr` reads (those of `AsyncRemoteEnv`).
ENV_ATTRIBUTES = (
    "url",
    "render_mode",
    "metadata",
    "observation_space",
    "action_space",
    "description",
    "session_id",
    "worker",
    "np_random",
    "np_random_seed",
)


class RemoteVecEnv(VecEnv):
    """An SB3 ``VecEnv`` of ``num_envs`` sessions on a gym-sessions server.

    Example:
        >>> from stable_baselines3 import PPO
        >>> from stable_baselines3.common.vec_env import VecMonitor
        >>> from gym_sessions.integrations.sb3 import RemoteVecEnv
        >>> env = VecMonitor(RemoteVecEnv("http://127.0.0.1:8000", num_envs=4))
        >>> model = PPO("MlpPolicy", env, n_steps=64, seed=0).learn(total_timesteps=1_024)
        >>> env.close()  # closes the 4 sessions on the server

    Args:
        url: The server's base URL.
        num_envs: Number of sessions.
        env_kwargs: Passed to `RemoteVectorEnv`: ``render_mode``, ``timeout``,
            ``retries``, ``headers``, ``max_episode_steps``, ``copy``,
            ``batch_group_size`` (the sessions are spread over the server's
            workers unless it is given). Not ``autoreset_mode``: SB3's
            autoreset is fixed (``SAME_STEP``).

    Raises:
        TypeError: ``autoreset_mode`` was given.
    """

    def __init__(
        self, url: str = "http://127.0.0.1:8000", num_envs: int = 1, **env_kwargs: Any
    ) -> None:
        if "autoreset_mode" in env_kwargs:
            raise TypeError(
                "RemoteVecEnv resets ended sub-envs within the step, as SB3 expects; "
                "do not pass autoreset_mode"
            )
        self.vector = RemoteVectorEnv(
            num_envs=num_envs, url=url, autoreset_mode=AutoresetMode.SAME_STEP, **env_kwargs
        )
        # SB3's __init__ reads get_attr("render_mode"), which needs num_envs.
        self.num_envs = num_envs
        try:
            super().__init__(
                num_envs, self.vector.single_observation_space, self.vector.single_action_space
            )
        except BaseException:
            self.vector.close()
            raise
        # As DummyVecEnv does: the env's own metadata (render_fps for VecVideoRecorder).
        self.metadata = dict(self.vector.description.metadata)
        self._actions: np.ndarray | None = None

    # Sessions ------------------------------------------------------------------------------

    @property
    def workers(self) -> tuple[str | None, ...]:
        """The server worker holding each sub-env's session (known after the first reset)."""
        return self.vector.workers

    @property
    def session_ids(self) -> tuple[str, ...]:
        """Each sub-env's session id."""
        return self.vector.session_ids

    # Seeds and options ---------------------------------------------------------------------

    def seed(self, seed: int | None = None) -> Sequence[int | None]:
        """Seed the remote envs at the next ``reset()``: sub-env ``i`` gets ``seed + i``.

        As every SB3 ``VecEnv`` since Gymnasium: nothing reaches the server until
        the reset, which sends each session its seed (``POST /reset``), so a
        seeded run replays the same episodes. ``None`` draws a random seed.

        Example:
            >>> env.seed(0)
            [0, 1, 2, 3]
            >>> obs = env.reset()  # the same first observations on every seeded run
        """
        return super().seed(seed)

    def set_options(self, options: list[dict[str, Any]] | dict[str, Any] | None = None) -> None:
        """Reset options for the next ``reset()``; one dict for all sub-envs.

        Raises:
            ValueError: A list gives sub-envs different options: a Gymnasium
                vector env passes one ``options`` dict to every sub-env.
        """
        if isinstance(options, list) and any(o != options[0] for o in options):
            raise ValueError(
                "RemoteVecEnv passes the same reset options to every sub-env; "
                f"got different options per sub-env: {options!r}"
            )
        super().set_options(options)

    # VecEnv API --------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every session with the pending seeds and options; returns the observations."""
        options = self._options[0] if self._options and self._options[0] else None
        observations, infos = self.vector.reset(seed=list(self._seeds), options=options)
        self.reset_infos = [sub_env_info(infos, i) for i in range(self.num_envs)]
        # Seeds and options are used once, as in DummyVecEnv.
        self._reset_seeds()
        self._reset_options()
        self._actions = None
        return observations

    def step_async(self, actions: np.ndarray) -> None:
        """Keep the actions for `step_wait` (which sends them, all sessions at once)."""
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        """Step every session concurrently; ended sub-envs are reset in the same step.

        Raises:
            RuntimeError: `step_async` was not called first.
            SessionGoneError: A sub-env's worker has exited (``error.env_index``
                names it); ``reset()`` replaces the lost session.
        """
        if self._actions is None:
            raise RuntimeError("call step_async(actions) before step_wait()")
        actions, self._actions = self._actions, None
        observations, rewards, terminations, truncations, infos = self.vector.step(
            self._batched_actions(actions)
        )
        dones = np.logical_or(terminations, truncations)
        step_infos: list[dict[str, Any]] = []
        for i in range(self.num_envs):
            info = sub_env_info(infos, i)
            final_observation = None
            if dones[i]:
                # SAME_STEP merged the end of the episode under final_*; the rest
                # of the info is the new episode's reset info.
                final_observation = info.pop("final_obs")
                final_info = info.pop("final_info", {})
                self.reset_infos[i] = info
                info = final_info
            info["TimeLimit.truncated"] = bool(truncations[i] and not terminations[i])
            if dones[i]:
                info["terminal_observation"] = final_observation
            step_infos.append(info)
        # SB3 buffers rewards as float32 (DummyVecEnv does too).
        return observations, rewards.astype(np.float32), dones, step_infos

    def _batched_actions(self, actions: Any) -> Any:
        """SB3's actions (``actions[i]`` is sub-env ``i``'s) as a Gymnasium batch.

        An array of a Box, Discrete, MultiDiscrete or MultiBinary space already
        is one; a list (of Dict or Tuple actions, as ``DummyVecEnv`` takes)
        is batched by the space.

        Raises:
            ValueError: Another number of actions than ``num_envs``.
        """
        space = self.action_space
        if isinstance(actions, np.ndarray) and not isinstance(space, spaces.Dict | spaces.Tuple):
            return actions
        if isinstance(actions, dict) and isinstance(space, spaces.Dict):
            return actions  # already batched per key, as a Gymnasium vector env takes them
        if len(actions) != self.num_envs:
            raise ValueError(
                f"step_async needs one action per sub-env ({self.num_envs}), got {len(actions)}"
            )
        batch: Any = create_empty_array(space, self.num_envs)
        return concatenate(space, [actions[i] for i in range(self.num_envs)], batch)

    def close(self) -> None:
        """Close every remote session (concurrently) and the vector env's event loop thread."""
        self.vector.close()

    def get_images(self) -> Sequence[np.ndarray | None]:
        """One ``rgb_array`` frame per sub-env, fetched concurrently (``POST /render``).

        Without ``render_mode="rgb_array"`` it warns and returns ``None`` per
        sub-env, as ``DummyVecEnv`` does.
        """
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but get_images needs "
                "RemoteVecEnv(..., render_mode='rgb_array')",
                stacklevel=2,
            )
            return [None] * self.num_envs
        return list(self.vector.render())

    # Sub-env attributes and methods ------------------------------------------------------

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """An attribute of each sub-env's local proxy (`AsyncRemoteEnv`).

        ``render_mode``, ``metadata``, the spaces, ``session_id``, ``worker``, ...
        (`ENV_ATTRIBUTES`). The served env's own attributes stay on the server.

        Example:
            >>> env.get_attr("worker")  # the worker holding each session
            ['4242-1a2b3c4d', '4243-5e6f7a8b', ...]

        Raises:
            AttributeError: Any other name (so SB3's ``has_attr`` says False).
        """
        if attr_name not in ENV_ATTRIBUTES:
            raise AttributeError(
                f"RemoteVecEnv cannot read {attr_name!r}: the served env's attributes live on "
                f"the server, out of reach over HTTP; its sub-envs have {list(ENV_ATTRIBUTES)}"
            )
        return [getattr(self.vector.envs[i], attr_name) for i in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Always refused: a setting on the local proxy would never reach the served env.

        Raises:
            AttributeError: Always; configure the served env with ``gym-sessions
                serve ... --env-kwargs`` or reset options (`set_options`).
        """
        raise AttributeError(
            f"RemoteVecEnv cannot set {attr_name!r}: the served env lives on the server; "
            "configure it with `gym-sessions serve ... --env-kwargs '{...}'` "
            "or pass reset options with set_options()"
        )

    def env_method(
        self,
        method_name: str,
        *method_args: Any,
        indices: VecEnvIndices = None,
        **method_kwargs: Any,
    ) -> list[Any]:
        """Call ``render`` or ``verify`` (`ENV_METHODS`) of the chosen sub-envs, concurrently.

        Example:
            >>> env.env_method("verify", indices=[0])  # the server's /verify of sub-env 0
            [{'reward': 1.0, ...}]

        Raises:
            AttributeError: Another method: ``reset``, ``step`` and ``close``
                belong to the VecEnv itself, and the served env's own methods
                stay on the server.
        """
        if method_name not in ENV_METHODS:
            raise AttributeError(
                f"RemoteVecEnv cannot call {method_name!r} on its sub-envs: it calls "
                f"{list(ENV_METHODS)}; use the VecEnv's own reset/step_async/step_wait/close, "
                "and the served env's own methods stay on the server"
            )
        return list(
            self.vector.call_on(
                self._get_indices(indices), method_name, *method_args, **method_kwargs
            )
        )

    def env_is_wrapped(
        self, wrapper_class: type[Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """False for every sub-env: no Gymnasium wrapper runs on this side.

        The served env's wrappers (a ``TimeLimit``, say) run on the server and
        cannot be seen from here; so SB3 counts episodes with ``VecMonitor``
        (which this answer lets it use without a warning), not ``Monitor``.
        """
        return [False for _ in self._get_indices(indices)]
