"""Optional extras (``sb3``, ``pandas``): never imported by the package, a clear hint when missing.

A ``None`` entry in ``sys.modules`` makes ``import name`` raise ImportError, as
if the library were not installed; each case runs in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_without_pandas_to_dataframe_says_how_to_install_it():
    # A None entry in sys.modules makes `import pandas` raise ImportError, as if absent.
    result = run_python(
        "import sys; sys.modules['pandas'] = None\n"
        "from gym_sessions.client import to_dataframe\n"
        "try:\n    to_dataframe([{'reward': 1.0}])\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'gym-sessions[pandas]'" in result.stdout


def test_importing_the_package_imports_no_optional_library():
    result = run_python(
        "import sys, gym_sessions, gym_sessions.client, gym_sessions.integrations\n"
        "print(sorted(m for m in ('pandas', 'torch', 'stable_baselines3') if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_without_stable_baselines3_the_integration_says_how_to_install_it():
    result = run_python(
        "import sys; sys.modules['stable_baselines3'] = None\n"
        "try:\n    import gym_sessions.integrations.sb3\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'gym-sessions[sb3]'" in result.stdout


def test_without_verl_the_integration_says_how_to_install_it():
    result = run_python(
        "import sys; sys.modules['verl'] = None\n"
        "try:\n    import gym_sessions.integrations.verl\n"
        "except ImportError as exc:\n    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'gym-sessions[verl]'" in result.stdout
