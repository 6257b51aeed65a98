"""Out of file descriptors, a step is refused before it runs or answers its result (issue 33).

A real 2-worker counter server runs under ``prlimit --nofile``: each session
keeps one connection open, then idle connections fill every worker's
descriptor table, and each session steps once. A step's reply must then be its
result (200) or a refusal (503 ``overloaded``) of a step that did not run;
``/observe``, once the idle connections are gone, tells which. Before the fix
a step ran and then answered 500 ``internal_error`` naming a metrics file in
the runtime directory, because opening it failed after ``env.step``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import socket
import time
import urllib.parse
from collections.abc import Iterator

import pytest

from gym_sessions.server.process import start_server

pytestmark = pytest.mark.e2e

#: Descriptors per worker: a worker starts with about 30 open.
NOFILE = 64
SESSIONS = 12
FLOOD = 400


class Session:
    """One counter session on its own kept-alive connection."""

    def __init__(self, host: str, port: int) -> None:
        self.connection = http.client.HTTPConnection(host, port, timeout=30)
        self.cookie = ""
        status, _, headers = self.post("/reset", {"options": {"initial_count": 0}})
        assert status == 200
        self.cookie = headers["set-cookie"].split(";", 1)[0]

    def post(self, path: str, body: dict) -> tuple[int, dict, dict[str, str]]:
        headers = {"Content-Type": "application/json"}
        if self.cookie:
            headers["Cookie"] = self.cookie
        self.connection.request("POST", path, json.dumps(body), headers)
        reply = self.connection.getresponse()
        data = reply.read()
        return reply.status, json.loads(data), {k.lower(): v for k, v in reply.getheaders()}


def _open_descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@contextlib.contextmanager
def _flood(host: str, port: int, n: int) -> Iterator[list[socket.socket]]:
    """``n`` idle connections to the server (each one a worker's descriptor once accepted)."""
    sockets = []
    try:
        for _ in range(n):
            with contextlib.suppress(OSError):
                sockets.append(socket.create_connection((host, port), timeout=5))
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def test_a_step_out_of_descriptors_is_refused_before_it_runs_or_returns_its_result(short_tmp):
    if shutil.which("prlimit") is None:
        pytest.skip("prlimit (util-linux) is not installed")
    server = start_server(
        "envs.counter:CounterEnv",
        "--placement",
        "local",  # each session on the worker its connection reached: no hop, no handoff
        workers=2,
        tmpdir=os.path.join(short_tmp, "s"),
        launcher=("prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"),
    )
    try:
        url = urllib.parse.urlsplit(server.url)
        host, port = url.hostname, url.port
        assert host is not None and port is not None
        sessions = [Session(host, port) for _ in range(SESSIONS)]
        workers = server.worker_pids()
        with _flood(host, port, FLOOD):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and any(
                _open_descriptors(pid) < NOFILE for pid in workers
            ):
                time.sleep(0.1)
            assert all(_open_descriptors(pid) >= NOFILE for pid in workers)
            replies = [session.post("/step", {"action": 1})[:2] for session in sessions]
        # The idle connections are gone: every worker has descriptors again. A new
        # connection each (a failed step may have closed its own): the cookie
        # reaches the session's worker.
        lengths = []
        for session in sessions:
            session.connection.close()
            session.connection = http.client.HTTPConnection(host, port, timeout=30)
            lengths.append(session.post("/observe", {})[1]["episode_length"])
    finally:
        server.stop()
    for (status, body), length in zip(replies, lengths, strict=True):
        if status == 200:
            assert length == 1 and body["observation"] == 1, (status, body, length)
        else:
            assert (status, body["error"]["code"], length) == (503, "overloaded", 0), (
                status,
                body,
                length,
            )
            assert short_tmp not in body["error"]["message"]
