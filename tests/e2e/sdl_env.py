"""The counter that reports its worker's SDL drivers in every reset's info."""

from __future__ import annotations

import os
from typing import Any

from envs.counter import CounterEnv

SDL_VARIABLES = ("SDL_VIDEODRIVER", "SDL_AUDIODRIVER")


class SdlReportingCounterEnv(CounterEnv):
    """`CounterEnv` whose reset info holds ``sdl``: the SDL variables as its worker has them."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        observation, info = super().reset(seed=seed, options=options)
        return observation, {**info, "sdl": {name: os.environ.get(name) for name in SDL_VARIABLES}}
