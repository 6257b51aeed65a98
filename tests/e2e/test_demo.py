"""``gym-sessions demo``, the README's first quick-start command, end to end."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

TIMEOUT_SECONDS = 180.0
DEMO = [sys.executable, "-m", "gym_sessions", "demo"]


def test_demo_scores_every_episode_in_every_batch():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [*DEMO, "--workers", "2", "--episodes", "20", "--concurrency", "4"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_SECONDS)
    finally:
        if process.poll() is None:
            # The demo stops its server when it gets SIGTERM; SIGKILL would orphan it.
            process.send_signal(signal.SIGTERM)
            try:
                process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate(timeout=5)

    assert process.returncode == 0, output
    scores = re.findall(r"reward 1\.0\s+(\d+)/(\d+)", output)
    assert scores == [("20", "20")] * 3, output
    assert "keep_alive=True" in output
    assert "keep_alive=False" in output
    assert "counter agent's /run" in output
