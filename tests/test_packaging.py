"""What the wheel installs: every package of gym_sessions, the examples under it, no ``envs``."""

import importlib
import os
import tomllib

import gymnasium as gym
import pytest

import gym_sessions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as file:
        return tomllib.load(file)


def test_every_package_of_the_source_tree_is_listed_for_the_wheel():
    found = set()
    for directory, _, files in os.walk(os.path.join(ROOT, "gym_sessions")):
        if "__init__.py" in files:
            found.add(os.path.relpath(directory, ROOT).replace(os.sep, "."))
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    assert found | {"gym_sessions.examples"} == listed


def test_examples_install_under_gym_sessions_not_as_a_top_level_envs():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"gym_sessions.examples": "envs"}
    assert not any(name == "envs" or name.startswith("envs.") for name in setuptools["packages"])


def test_the_examples_import_under_their_installed_name():
    counter = importlib.import_module("gym_sessions.examples.counter")
    assert counter.__file__ == os.path.join(ROOT, "envs", "counter.py")
    # cpu_counter imports counter relatively, so it works under either name.
    cpu = importlib.import_module("gym_sessions.examples.cpu_counter")
    assert issubclass(cpu.CpuCounterEnv, counter.CounterEnv)


@pytest.mark.parametrize("env_id", ["gym_sessions/Counter-v0", "gym_sessions/CpuCounter-v0"])
def test_example_envs_are_registered_gymnasium_ids(env_id):
    env = gym.make(env_id)
    try:
        observation, _ = env.reset(seed=0)
        assert env.observation_space.contains(observation)
    finally:
        env.close()


def test_version_comes_from_the_package_metadata():
    assert gym_sessions.__version__ == importlib.metadata.version("gym-sessions")
