"""What importing the package loads: a server's workers never load the client.

Each case runs in a fresh interpreter (``sys.modules`` of this one is full).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
{imports}
loaded = sorted(m for m in {modules} if m in sys.modules)
print(",".join(loaded))
"""


def _loaded(imports: str, modules: tuple[str, ...]) -> list[str]:
    code = CHECK.format(imports=imports, modules=modules)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return [m for m in result.stdout.strip().split(",") if m]


@pytest.mark.parametrize("target", ["CartPole-v1", "envs.counter:CounterEnv"])
def test_an_env_servers_worker_loads_neither_the_client_nor_aiohttp(target):
    imports = (
        "import gym_sessions.server.worker\n"
        "from gym_sessions.server.targets import load_target\n"
        f"load_target({target!r})"
    )
    assert _loaded(imports, ("aiohttp", "gym_sessions.client", "gym_sessions.server.agent")) == []


def test_importing_the_package_registers_the_remote_env_without_loading_the_client():
    imports = (
        "import gym_sessions, gymnasium\nassert 'gym_sessions/Remote-v0' in gymnasium.registry"
    )
    assert _loaded(imports, ("aiohttp", "gym_sessions.client", "starlette")) == []


@pytest.mark.parametrize(
    ("module", "name", "loads"),
    [
        ("gym_sessions", "RemoteEnv", "gym_sessions.client"),
        ("gym_sessions", "run_episodes", "gym_sessions.client"),
        ("gym_sessions.server", "AgentServer", "gym_sessions.server.agent"),
        ("gym_sessions.server", "ScriptedPolicy", "gym_sessions.server.policies"),
    ],
)
def test_a_lazily_loaded_name_is_the_real_object_and_listed(module, name, loads):
    # ``loads``: the module that importing the package alone leaves out.
    imports = (
        f"import importlib\nm = importlib.import_module({module!r})\n"
        f"assert {loads!r} not in sys.modules\n"
        f"from {module} import {name}\n"
        f"assert getattr(m, {name!r}) is {name} and {name!r} in dir(m) and {name!r} in m.__all__"
    )
    assert _loaded(imports, (loads,)) == [loads]


def test_the_client_loads_no_aiohttp():
    # Its connections are our own (`http11`); aiohttp is the agent server's, for models.
    imports = "from gym_sessions import AsyncRemoteEnv, ConnectionPool, RemoteEnv, RemoteVectorEnv"
    assert _loaded(imports, ("aiohttp",)) == []
