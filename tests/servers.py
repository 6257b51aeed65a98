"""Real ``gym-sessions serve`` processes for tests, stopped by their own PID."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

_LISTENING = re.compile(r"on http://(\S+):(\d+) with")


@dataclass
class ServerProcess:
    """A running server: its URL, process and private temp directory."""

    process: subprocess.Popen
    url: str
    tmpdir: str
    log_path: str
    extra: dict = field(default_factory=dict)

    def runtime_dirs(self) -> list[str]:
        return glob.glob(os.path.join(self.tmpdir, "gym-sessions-*"))

    def claim_files(self) -> list[str]:
        return [
            path
            for path in glob.glob(os.path.join(self.tmpdir, "gym-sessions-*", "claims", "*"))
            if not os.path.basename(path).startswith(".")
        ]

    def worker_sockets(self) -> list[str]:
        return glob.glob(os.path.join(self.tmpdir, "gym-sessions-*", "workers", "*.sock"))

    def health(self) -> dict:
        with urllib.request.urlopen(self.url + "/health", timeout=5) as reply:
            return json.loads(reply.read())

    def log(self) -> str:
        with open(self.log_path) as file:
            return file.read()

    def stop(self, timeout: float = 15.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        return self.process.returncode


def start_server(
    target: str, tmpdir: str, *args: str, workers: int = 1, ready_timeout: float = 60.0
) -> ServerProcess:
    """Start ``gym-sessions serve TARGET --port 0`` and wait until every worker answers."""
    os.makedirs(tmpdir, exist_ok=True)
    log_path = os.path.join(tmpdir, "server.log")
    env = {**os.environ, "TMPDIR": tmpdir, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_sessions",
                "serve",
                target,
                "--port",
                "0",
                "--workers",
                str(workers),
                "--log-level",
                "warning",
                *args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    server = ServerProcess(process, "", tmpdir, log_path)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited early ({process.returncode}):\n{server.log()}")
        match = _LISTENING.search(server.log())
        if match:
            server.url = f"http://{match.group(1)}:{match.group(2)}"
            try:
                server.health()
            except OSError:
                pass
            else:
                routed = workers > 1 and "--no-routing" not in args
                if not routed or len(server.worker_sockets()) >= workers:
                    return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"server did not become ready:\n{server.log()}")
