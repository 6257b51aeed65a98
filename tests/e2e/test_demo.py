"""``gym-sessions demo``, the README's first quick-start command, end to end."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from .subprocesses import run_module

pytestmark = pytest.mark.e2e

TIMEOUT_SECONDS = 180.0


def test_demo_scores_every_episode_in_every_batch():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    code, output, _ = run_module(
        "demo",
        "--workers",
        "2",
        "--episodes",
        "20",
        "--concurrency",
        "4",
        timeout=TIMEOUT_SECONDS,
        env=env,
        stderr=subprocess.STDOUT,
    )

    assert code == 0, output
    scores = re.findall(r"reward 1\.0\s+(\d+)/(\d+)", output)
    assert scores == [("20", "20")] * 3, output
    assert "keep_alive=True" in output
    assert "keep_alive=False" in output
    assert "counter agent's /run" in output
