"""Run ``python -m gym_sessions ...`` to completion in a test, never leaving it running."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any


def run_module(*args: str, timeout: float, **popen: Any) -> tuple[int, str, str]:
    """Run ``python -m gym_sessions ARGS``; returns (exit code, stdout, stderr).

    If it is still running after ``timeout`` (a server that started instead of
    failing, a demo that hangs) it gets SIGTERM, so it stops its own children,
    and SIGKILL only if that does not end it.
    """
    process = subprocess.Popen(
        [sys.executable, "-m", "gym_sessions", *args],
        stdout=subprocess.PIPE,
        stderr=popen.pop("stderr", subprocess.PIPE),
        text=True,
        **popen,
    )
    stdout = stderr = ""
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                stdout, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate(timeout=5)
    return process.returncode, stdout or "", stderr or ""
