"""Registration of the remote environment with Gymnasium."""

from __future__ import annotations

import gymnasium as gym

REMOTE_ENV_ID = "gym_sessions/Remote-v0"

#: The example envs (the repository's ``envs/``, installed as
#: ``gym_sessions.examples``) by Gymnasium id: ``gym-sessions serve gym_sessions/Counter-v0``.
EXAMPLE_ENV_IDS = {
    "gym_sessions/Counter-v0": "gym_sessions.examples.counter:CounterEnv",
    "gym_sessions/CpuCounter-v0": "gym_sessions.examples.cpu_counter:CpuCounterEnv",
}


def register_envs() -> None:
    """Register ``gym_sessions/Remote-v0`` and the example envs (idempotent).

    ``gymnasium.make`` gives a `RemoteEnv`; ``gymnasium.make_vec`` gives a
    `RemoteVectorEnv` stepping ``num_envs`` sessions concurrently. The example
    envs are imported only when made.
    """
    for env_id, entry_point in EXAMPLE_ENV_IDS.items():
        if env_id not in gym.registry:
            gym.register(id=env_id, entry_point=entry_point)
    if REMOTE_ENV_ID in gym.registry:
        return
    gym.register(
        id=REMOTE_ENV_ID,
        entry_point="gym_sessions.client.remote_env:RemoteEnv",
        vector_entry_point="gym_sessions.client.vector_env:RemoteVectorEnv",
        disable_env_checker=True,
    )
