"""The public API: what `gym_sessions` and `gym_sessions.server` export, and import costs."""

import importlib
import subprocess
import sys

import gymnasium as gym
import pytest

MODULES = [
    "gym_sessions",
    "gym_sessions.errors",
    "gym_sessions.spaces",
    "gym_sessions.settings",
    "gym_sessions.credentials",
    "gym_sessions.client",
    "gym_sessions.client.records",
    "gym_sessions.client.vector_env",
    "gym_sessions.server",
    "gym_sessions.server.agent",
    "gym_sessions.server.policies",
    "gym_sessions.server.tools",
    "gym_sessions.routing.router",
    "gym_sessions.routing.session_ids",
    "gym_sessions.routing.claim_store",
    "gym_sessions.routing.owned_claims",
    "gym_sessions.routing.forwarder",
    "gym_sessions.server.process",
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


def test_the_client_api_and_every_error_import_from_the_package():
    import gym_sessions
    from gym_sessions import (  # noqa: F401
        AsyncRemoteEnv,
        GymSessionsError,
        RemoteEnv,
        RemoteVectorEnv,
        SessionGoneError,
        errors,
        run_episodes,
    )

    error_classes = [n for n in errors.__all__ if n.endswith("Error")]
    assert set(error_classes) <= set(gym_sessions.__all__)


def test_a_server_author_imports_from_one_module():
    from gym_sessions.server import (  # noqa: F401
        AgentServer,
        BodySchema,
        Field,
        GymEnvServer,
        Policy,
        ResourcesServer,
        ScriptedPolicy,
        Tool,
        start_server,
    )


def test_importing_the_package_loads_neither_starlette_nor_the_server():
    code = (
        "import sys, gym_sessions; "
        "print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('starlette', 'uvicorn') or m.startswith('gym_sessions.server')))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == "[]"
