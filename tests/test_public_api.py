"""Every public module's ``__all__`` names things that exist, and the package registers its env."""

import importlib

import gymnasium as gym
import pytest

MODULES = [
    "gym_sessions",
    "gym_sessions.errors",
    "gym_sessions.spaces",
    "gym_sessions.settings",
    "gym_sessions.credentials",
    "gym_sessions.client",
    "gym_sessions.server",
    "gym_sessions.server.agent",
    "gym_sessions.server.policies",
    "gym_sessions.server.tools",
    "gym_sessions.routing.router",
    "gym_sessions.routing.session_ids",
    "gym_sessions.routing.claim_store",
    "gym_sessions.routing.owned_claims",
    "gym_sessions.routing.forwarder",
    "gym_sessions.server_process",
    "gym_sessions.metrics",
    "gym_sessions.metrics.status",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_exist(name):
    module = importlib.import_module(name)
    assert module.__all__, name
    missing = [attr for attr in module.__all__ if not hasattr(module, attr)]
    assert missing == []


def test_importing_the_package_registers_the_remote_env():
    import gym_sessions  # noqa: F401

    spec = gym.spec("gym_sessions/Remote-v0")
    assert spec.entry_point == "gym_sessions.client.remote_env:RemoteEnv"
    assert spec.vector_entry_point is not None


def test_every_http_error_has_a_distinct_code():
    from gym_sessions import errors

    classes = [getattr(errors, n) for n in errors.__all__]
    http = [c for c in classes if isinstance(c, type) and issubclass(c, errors.HTTPError)]
    codes = [c.code for c in http if c is not errors.HTTPError]
    assert len(codes) == len(set(codes))
