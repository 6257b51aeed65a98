"""Workers render without a display and without SDL's noise, unless told otherwise.

A server started with no SDL variables in its environment (and no
``XDG_RUNTIME_DIR``, as on a headless host or in a container) renders
CartPole's ``rgb_array`` frames in every worker and logs not one SDL warning:
the workers set ``SDL_VIDEODRIVER`` and ``SDL_AUDIODRIVER`` to ``dummy`` when
unset. A value the server was started with is kept.
"""

from __future__ import annotations

import gymnasium as gym
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import RemoteEnv
from tests.e2e.sdl_env import SDL_VARIABLES

pytestmark = pytest.mark.e2e

#: What SDL prints on a host without a desktop session (one line per env that renders).
SDL_NOISE = ("XDG_RUNTIME_DIR", "ALSA lib", "SDL_")


@pytest.fixture
def no_sdl_environment(monkeypatch):
    for name in (*SDL_VARIABLES, "XDG_RUNTIME_DIR", "DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)


def test_headless_workers_render_without_sdl_warnings(serve, no_sdl_environment):
    server = serve("CartPole-v1", workers=2)
    envs = []
    for _ in range(6):
        env = gym.make("gym_sessions/Remote-v0", url=server.url, render_mode="rgb_array")
        envs.append(env)  # kept open: placement then starts the next on the emptier worker
        env.reset(seed=0)
        env.step(0)
        frame = env.render()
        assert frame.shape == (400, 600, 3) and frame.std() > 0
    workers = {env.unwrapped.worker for env in envs}
    for env in envs:
        env.close()
    assert len(workers) == 2  # every worker rendered
    server.stop()
    noise = [line for line in server.log().splitlines() if any(m in line for m in SDL_NOISE)]
    assert noise == []


def test_the_workers_set_sdl_drivers_only_where_unset(serve, no_sdl_environment, monkeypatch):
    target = "tests.e2e.sdl_env:SdlReportingCounterEnv"
    default = RemoteEnv(serve(target, workers=2).url)
    _, info = default.reset()
    default.close()
    assert info["sdl"] == {"SDL_VIDEODRIVER": "dummy", "SDL_AUDIODRIVER": "dummy"}

    monkeypatch.setenv("SDL_VIDEODRIVER", "x11")
    chosen = RemoteEnv(serve(target, workers=2).url)
    _, info = chosen.reset()
    chosen.close()
    assert info["sdl"] == {"SDL_VIDEODRIVER": "x11", "SDL_AUDIODRIVER": "dummy"}
