"""``gym-sessions`` as a user meets it: start-up errors, help, version, start and stop."""

from __future__ import annotations

import importlib.metadata
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from .subprocesses import run_module

pytestmark = pytest.mark.e2e

EXIT_STARTUP_FAILURE = 2
TIMEOUT_SECONDS = 60.0
# After SIGTERM a server shuts down gracefully, then exits 0 or re-raises the
# signal (uvicorn's single-process server does); -9 would mean it had to be killed.
CLEAN_EXIT = (0, -signal.SIGTERM)

NOT_AN_ENV_MODULE = """\
NOT_AN_ENV = {"a": 1}


def make_nothing():
    return None
"""


def run_cli(tmpdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m gym_sessions ARGS`` in ``tmpdir`` (cwd and TMPDIR); stop it by PID."""
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONUNBUFFERED": "1"}
    code, stdout, stderr = run_module(*args, timeout=TIMEOUT_SECONDS, cwd=tmpdir, env=env)
    return subprocess.CompletedProcess(args, code, stdout, stderr)


@pytest.fixture
def port_in_use() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def assert_one_error_line(result: subprocess.CompletedProcess[str], *mentions: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == EXIT_STARTUP_FAILURE, result.stderr
    assert len(lines) == 1, result.stderr
    (line,) = lines
    assert line.startswith("gym-sessions: error: "), line
    for mention in mentions:
        assert mention in line
    assert result.stdout == ""
    return line


@pytest.mark.parametrize(
    ("target", "mention"),
    [
        ("NoSuchEnv-v9", "NoSuchEnv-v9"),
        ("no_such_module_for_gym_sessions:Env", "no_such_module_for_gym_sessions"),
        ("gym_sessions.examples.counter:NoSuchAttribute", "NoSuchAttribute"),
        ("notenv:NOT_AN_ENV", "notenv:NOT_AN_ENV"),
        ("notenv:make_nothing", "notenv:make_nothing"),
    ],
    ids=["unknown-id", "missing-module", "missing-attribute", "not-callable", "returns-none"],
)
@pytest.mark.parametrize("workers", ["1", "2"])
def test_bad_target_is_one_error_line(short_tmp: str, target: str, mention: str, workers: str):
    tmpdir = Path(short_tmp)
    (tmpdir / "notenv.py").write_text(NOT_AN_ENV_MODULE)
    result = run_cli(tmpdir, "serve", target, "--port", "0", "--workers", workers)
    assert_one_error_line(result, mention)
    assert list(tmpdir.glob("gym-sessions-*")) == []


@pytest.mark.parametrize("workers", ["1", "2"])
def test_port_in_use_is_one_error_line(short_tmp: str, port_in_use: int, workers: str):
    tmpdir = Path(short_tmp)
    result = run_cli(
        tmpdir,
        *("serve", "CartPole-v1", "--host", "127.0.0.1", "--port", str(port_in_use)),
        *("--workers", workers),
    )
    assert_one_error_line(result, f"127.0.0.1:{port_in_use}")
    assert list(tmpdir.glob("gym-sessions-*")) == []


def test_serve_help_explains_routing_between_workers(short_tmp: str):
    result = run_cli(Path(short_tmp), "serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--workers" in text
    assert "routed to the worker" in text
    assert "--no-routing" in text


def test_serve_help_offers_a_secret_file_and_no_command_line_secret(short_tmp: str):
    result = run_cli(Path(short_tmp), "serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--secret-file PATH" in text and "$GYM_SESSIONS_SECRET" in text
    assert "umask 077" in text  # how to make a secret file
    # --secret is still parsed, only to refuse it (test_secrets.py); --help hides it.
    assert re.search(r"--secret(?!-file)", text) is None


def test_one_worker_serves_without_a_runtime_directory(serve):
    server = serve("CartPole-v1", workers=1)
    assert server.health()["status"] == "ok"
    assert server.runtime_dirs() == []
    assert server.stop() in CLEAN_EXIT
    assert server.runtime_dirs() == []


def test_two_workers_remove_their_runtime_directory_on_sigterm(serve):
    server = serve("CartPole-v1", workers=2)
    assert server.health()["status"] == "ok"
    (runtime_dir,) = server.runtime_dirs()
    assert len(server.worker_sockets()) == 2
    assert oct(os.stat(runtime_dir).st_mode & 0o777) == oct(0o700)
    assert server.stop() in CLEAN_EXIT
    assert server.runtime_dirs() == []


def test_version_names_the_installed_package(short_tmp: str):
    result = run_cli(Path(short_tmp), "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gym-sessions {importlib.metadata.version('gym-sessions')}"


def test_help_of_every_command_is_plain_text(short_tmp: str):
    main_help = run_cli(Path(short_tmp), "--help")
    assert main_help.returncode == 0, main_help.stderr
    (choices,) = re.findall(r"\{([\w,-]+)\}", main_help.stdout.splitlines()[0])
    commands = choices.split(",")
    assert {"serve", "reload", "demo"} <= set(commands)
    for args, result in [((), main_help)] + [
        ((command,), run_cli(Path(short_tmp), command, "--help")) for command in commands
    ]:
        assert result.returncode == 0, result.stderr
        # Docstring markup (``literal``) is for the API docs, not for a terminal.
        assert "``" not in result.stdout, f"gym-sessions {' '.join(args)} --help:\n{result.stdout}"


@pytest.mark.parametrize(
    ("env_kwargs", "mentions"),
    [
        ("{'size': 8}", ["--env-kwargs", "not valid JSON"]),
        ('[["size", 8]]', ["--env-kwargs", "JSON object"]),
        ('"size=8"', ["--env-kwargs", "JSON object"]),
        (
            '{"no_such_argument": 1}',
            ["gym_sessions.examples.counter:CounterEnv", "no_such_argument"],
        ),
    ],
    ids=["not-json", "array", "string", "unknown-argument"],
)
def test_bad_env_kwargs_are_one_error_line(short_tmp: str, env_kwargs: str, mentions: list[str]):
    tmpdir = Path(short_tmp)
    result = run_cli(
        tmpdir,
        "serve",
        "gym_sessions.examples.counter:CounterEnv",
        "--port",
        "0",
        "--env-kwargs",
        env_kwargs,
    )
    assert_one_error_line(result, *mentions)
    assert list(tmpdir.glob("gym-sessions-*")) == []


def test_env_kwargs_for_a_server_target_are_one_error_line(short_tmp: str):
    result = run_cli(
        Path(short_tmp),
        *(
            "serve",
            "gym_sessions.examples.counter_agent:CounterAgent",
            "--port",
            "0",
            "--env-kwargs",
            '{"a": 1}',
        ),
    )
    assert_one_error_line(result, "gym_sessions.examples.counter_agent:CounterAgent", "env kwargs")


@pytest.mark.parametrize(
    ("option", "value", "mention"),
    [
        ("--claims-timeout", "0", "claims_timeout"),
        ("--private-idle-timeout", "-1", "private_idle_timeout"),
        ("--private-max-connections", "0", "private_max_connections"),
        ("--worker-start-timeout", "0", "worker_start_timeout"),
    ],
)
def test_bad_several_hosts_limits_are_one_error_line(
    short_tmp: str, option: str, value: str, mention: str
):
    result = run_cli(
        Path(short_tmp),
        "serve",
        "gym_sessions.examples.counter:CounterEnv",
        "--port",
        "0",
        option,
        value,
    )
    assert_one_error_line(result, mention)


@pytest.mark.parametrize(
    ("target", "args", "mention"),
    [
        ("envs.counter_agent:CounterAgent", ("--allow-env", "127.0.0.1:8000"), "--allow-env"),
        ("envs.counter_agent:CounterAgent", ("--allow-env", "http://h:1/?x=/admin"), "query"),
        ("envs.counter_agent:CounterAgent", ("--allow-model", "http://user:pw@h:1"), "credentials"),
        # Imported from any directory: the examples as installed.
        (
            "gym_sessions.examples.counter:CounterEnv",
            ("--allow-env", "http://127.0.0.1:8000"),
            "agent servers",
        ),
    ],
    ids=["no-scheme", "query", "credentials", "not-an-agent"],
)
def test_a_bad_allow_list_is_one_error_line(short_tmp: str, target, args, mention):
    result = run_cli(Path(short_tmp), "serve", target, "--port", "0", *args)
    assert_one_error_line(result, mention)
