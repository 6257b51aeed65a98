"""Run ``redis-server`` and ``nginx`` as child processes on loopback; see claims and registrations.

For the tests, the benchmarks and trying several "hosts" on one machine: each
gets a private temporary directory, a free loopback port and is stopped by its
own PID. Neither program is installed by gym-sessions (Debian:
``apt-get install -y redis-server nginx``); `require` says so in one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence

__all__ = [
    "NginxProcess",
    "RedisDatabase",
    "RedisProcess",
    "claim_owner",
    "free_port",
    "registered_workers",
    "require",
    "run_nginx",
    "run_redis",
    "wait_for_registrations",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require(program: str, package: str) -> str:
    """The path of ``program``; `FileNotFoundError` naming the Debian package if missing."""
    path = shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/bin:/sbin")
    if path is None:
        raise FileNotFoundError(
            f"{program} is not installed (Debian: apt-get install -y {package})"
        )
    return path


def _stop(process: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


def _tail(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as file:
        return file.read()[-2000:]
    return ""


class RedisProcess:
    """A ``redis-server`` on 127.0.0.1 with no persistence: a restart starts empty.

    Args:
        port: Port to listen on (a free one by default); `start` after `stop`
            listens on the same port again.
    """

    def __init__(self, port: int | None = None, databases: int = 16) -> None:
        self.program = require("redis-server", "redis-server")
        self.port = port or free_port()
        self.databases = databases
        self.dir = tempfile.mkdtemp(prefix="gs-redis-", dir="/tmp")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The URL to pass as ``--claims`` (database 0)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20.0) -> RedisProcess:
        """Start and wait until it answers PING."""
        log_path = os.path.join(self.dir, "redis.log")
        command = [
            self.program,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", self.dir,
            "--daemonize", "no",
            "--databases", str(self.databases),
            "--logfile", log_path,
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited: {stderr}{_tail(log_path)}")
            if self.ping():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer in {timeout} s: {_tail(log_path)}")

    def flush(self, db: int) -> None:
        """Empty database ``db``."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(f"SELECT {db}\r\nFLUSHDB\r\n".encode())
            answers = b""
            while answers.count(b"\r\n") < 2:
                chunk = sock.recv(64)
                if not chunk:
                    break
                answers += chunk
        if answers != b"+OK\r\n+OK\r\n":
            raise RuntimeError(f"redis-server refused FLUSHDB {db}: {answers!r}")

    def ping(self) -> bool:
        """Whether the server answers PING."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop the server (its data is gone)."""
        if self.process is not None:
            _stop(self.process)
            if self.process.stderr:
                self.process.stderr.close()
            self.process = None

    def close(self) -> None:
        """Stop and remove its directory."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisDatabase:
    """One database of a shared `RedisProcess`, emptied when made: what a test that
    neither stops nor breaks Redis needs (keys are per database; nothing here uses
    Redis pub/sub, which is not)."""

    def __init__(self, server: RedisProcess, db: int) -> None:
        server.flush(db)
        self.server = server
        self.db = db

    @property
    def url(self) -> str:
        """The URL to pass as ``--claims``."""
        return f"redis://127.0.0.1:{self.server.port}/{self.db}"


@contextlib.contextmanager
def run_redis() -> Iterator[RedisProcess]:
    """A fresh `RedisProcess` for the block."""
    server = RedisProcess()
    try:
        yield server.start()
    finally:
        server.close()


_NGINX_CONF = """\
worker_processes {workers};
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 100000;
    upstream gym {{
{balance}
{servers}
        keepalive 64;
        keepalive_requests 100000;
    }}
    server {{
        listen 127.0.0.1:{port};
        location = /ws {{
            # WebSocket sessions (docs/design.md 3.16): the upgrade passed on.
            proxy_pass http://gym;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection "upgrade";
            proxy_set_header Host $host;
            proxy_read_timeout 300s;
        }}
        location / {{
            proxy_pass http://gym;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
        }}
    }}
}}
"""

# Round robin is nginx's default (no directive); the sticky variant hashes a
# header the client sets to its session id, the usual way to pin sessions.
BALANCING = {"round_robin": "", "sticky_header": "        hash $http_x_session_id consistent;"}


class NginxProcess:
    """An nginx in front of ``upstreams`` (``http://host:port`` URLs), on 127.0.0.1.

    Args:
        upstreams: The servers it balances over.
        balance: ``round_robin`` (each request to the next server) or
            ``sticky_header`` (consistent hash of ``X-Session-Id``).
        workers: nginx worker processes (``auto``: one per core).
        server_options: Parameters of every ``server`` line, e.g. ``max_fails=0``
            (never take a server for down: nginx's default takes one error for
            10 s of down, and with every server down answers 502 at once).
    """

    def __init__(
        self,
        upstreams: Sequence[str],
        balance: str = "round_robin",
        workers: str = "auto",
        server_options: str = "",
    ) -> None:
        self.program = require("nginx", "nginx")
        self.prefix = tempfile.mkdtemp(prefix="gs-nginx-", dir="/tmp")
        os.chmod(self.prefix, 0o755)  # nginx workers may run as another user
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(
            f"        server {url.split('://', 1)[1]} {server_options};".replace(" ;", ";")
            for url in upstreams
        )
        self.conf = os.path.join(self.prefix, "nginx.conf")
        with open(self.conf, "w") as file:
            file.write(
                _NGINX_CONF.format(
                    prefix=self.prefix,
                    servers=servers,
                    port=self.port,
                    balance=BALANCING[balance],
                    workers=workers,
                )
            )
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> NginxProcess:
        """Start and wait until it proxies ``GET /health``."""
        error_log = os.path.join(self.prefix, "error.log")
        with open(os.path.join(self.prefix, "stderr.log"), "wb") as log:
            self.process = subprocess.Popen(
                [self.program, "-c", self.conf, "-p", self.prefix, "-e", error_log,
                 "-g", "daemon off;"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited ({self.process.returncode}): {self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    reply.read()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"nginx did not serve: {self.log()}") from None
                time.sleep(0.1)

    def log(self) -> str:
        """The end of nginx's logs."""
        return "\n".join(_tail(os.path.join(self.prefix, n)) for n in ("stderr.log", "error.log"))

    def close(self) -> None:
        """Stop nginx and remove its directory."""
        if self.process is not None:
            _stop(self.process)
            self.process = None
        shutil.rmtree(self.prefix, ignore_errors=True)


@contextlib.contextmanager
def run_nginx(
    upstreams: Sequence[str], balance: str = "round_robin", workers: str = "auto"
) -> Iterator[NginxProcess]:
    """A started `NginxProcess` for the block."""
    proxy = NginxProcess(upstreams, balance, workers)
    try:
        yield proxy.start()
    finally:
        proxy.close()


def claim_owner(runtime_dir: str, session_id: str) -> str | None:
    """The worker id in a session's claim file (a server with file claims), or ``None``."""
    from gym_sessions.routing.claim_store import FileClaimStore
    from gym_sessions.runtime_dir import RuntimeDirectory

    return FileClaimStore(RuntimeDirectory(runtime_dir).claims_dir, "reader").read_now(session_id)


def registered_workers(redis_url: str) -> set[str]:
    """The ids of the workers registered in Redis (servers with Redis claims)."""
    import redis

    from gym_sessions.routing.keys import REGISTRATION_PREFIX

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = client.scan_iter(match=REGISTRATION_PREFIX + "*", count=1000)
        return {key.removeprefix(REGISTRATION_PREFIX) for key in keys}
    finally:
        client.close()


def wait_for_registrations(redis_url: str, expected: int, timeout: float = 30.0) -> set[str]:
    """Wait until at least ``expected`` workers registered in Redis; returns their ids.

    Raises:
        RuntimeError: fewer registered within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while True:
        workers = registered_workers(redis_url)
        if len(workers) >= expected:
            return workers
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(workers)} of {expected} workers registered in Redis")
        time.sleep(0.05)
