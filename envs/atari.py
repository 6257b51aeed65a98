"""ALE Pong as deep-RL agents see it, to serve: ``gym-sessions serve envs.atari:pong``.

The ``atari`` extra (``pip install 'gym-sessions[atari]'``: ``ale-py``, ROMs
included). `pong` is the usual DQN/PPO preprocessing on the server side:
ALE's frames unskipped (``frameskip=1``), then Gymnasium's
``AtariPreprocessing`` (no-op starts, a frame skip of 4 with max-pooling,
84x84 grayscale) and ``FrameStackObservation`` of 4, so each observation is a
``(4, 84, 84)`` ``uint8`` array (28,224 bytes, sent as its raw bytes in the
binary values encoding). Server-side preprocessing sends a quarter of the
frames, each a seventh of the size, compared with preprocessing on the client.

    gym-sessions serve envs.atari:pong --workers 4
    gym-sessions serve envs.atari:pong --env-kwargs '{"max_episode_steps": 1000}'
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TimeLimit

__all__ = ["pong"]


def pong(*, stack: int = 4, max_episode_steps: int | None = None, **preprocessing: Any) -> gym.Env:
    """``ALE/Pong-v5`` with ``AtariPreprocessing(**preprocessing)`` and a stack of ``stack`` frames.

    Args:
        stack: Frames per observation (``FrameStackObservation``).
        max_episode_steps: Steps (of 4 frames each) after which an episode is
            truncated; ``None``: ALE's own limit.
        preprocessing: Options of ``AtariPreprocessing`` (``screen_size``,
            ``noop_max``, ``terminal_on_life_loss``, ...).
    """
    import ale_py  # the atari extra; imported here so that importing envs needs no ale-py

    gym.register_envs(ale_py)
    env = gym.make("ALE/Pong-v5", frameskip=1)
    env = FrameStackObservation(AtariPreprocessing(env, **preprocessing), stack)
    if max_episode_steps is not None:  # outermost: it counts steps, not ALE's frames
        env = TimeLimit(env, max_episode_steps)
    return env
