"""Registration of the remote environment with Gymnasium."""

from __future__ import annotations

import gymnasium as gym

REMOTE_ENV_ID = "gym_sessions/Remote-v0"


def register_envs() -> None:
    """Register ``gym_sessions/Remote-v0`` (idempotent).

    ``gymnasium.make`` gives a `RemoteEnv`; ``gymnasium.make_vec`` gives a
    `RemoteVectorEnv` stepping ``num_envs`` sessions concurrently.
    """
    if REMOTE_ENV_ID in gym.registry:
        return
    gym.register(
        id=REMOTE_ENV_ID,
        entry_point="gym_sessions.client.remote_env:RemoteEnv",
        vector_entry_point="gym_sessions.client.vector_env:RemoteVectorEnv",
        disable_env_checker=True,
    )
