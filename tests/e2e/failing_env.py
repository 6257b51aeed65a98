"""An env whose step raises for odd actions: the server must answer 500 env_error and go on."""

import gymnasium as gym
import numpy as np


class FailingEnv(gym.Env):
    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        if action == 1:
            return 1 / 0
        return np.zeros(2, dtype=np.float32), 1.0, False, False, {}
