"""Every fenced ``python`` and ``bash`` block of README.md runs as written.

A Python block's first line says what it is, so nothing is skipped silently:

- ``# NAME.py``: a module the README asks the reader to save. Every such
  module is written to one directory, which is on the import path of the
  servers and the snippets, and each is imported once in a fresh interpreter.
- ``# server: gym-sessions serve TARGET ARGS``: a script to run while that
  server listens on port 8000. The test starts the server (one per distinct
  command, shared by the whole module), replaces ``http://127.0.0.1:8000``
  with the server's URL and changes nothing else, runs the block as a script
  in a subprocess and expects exit status 0 and no traceback.

Any other Python block fails. A block that imports the library of an optional
extra (``stable_baselines3``: ``sb3``) skips with the install command when it
is missing, and fails on CI. A bash block starts its own servers: it runs
with its ports (8000-8099) moved to free ones, in a process group of its own
that is stopped by its id afterwards.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gym_sessions.server.process import ServerProcess, start_server
from tests.conftest import import_extra_or_skip

pytestmark = pytest.mark.e2e

README = Path(__file__).parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"
SERVER_LINE = "# server: "
MODULE_LINE = re.compile(r"# (?P<module>[A-Za-z_]\w*)\.py")
SNIPPET_TIMEOUT = 180.0
#: Libraries of optional extras that README blocks import, and their extras.
EXTRA_LIBRARIES = {"stable_baselines3": "sb3", "pandas": "pandas"}


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, the README line it starts on, its code."""

    language: str
    line: int
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code.strip() else ""


def fenced_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, indented ones (inside lists) dedented."""
    blocks = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        opening = re.fullmatch(r"(?P<indent> *)```(?P<language>[\w-]*)\s*", lines[index])
        index += 1
        if opening is None:
            continue
        indent = opening["indent"]
        start = index
        while index < len(lines) and lines[index].strip() != "```":
            index += 1
        body = [line.removeprefix(indent) for line in lines[start:index]]
        blocks.append(Block(opening["language"], start, "\n".join(body) + "\n"))
        index += 1  # past the closing fence
    return blocks


BLOCKS = fenced_blocks(README.read_text())
PYTHON_BLOCKS = [block for block in BLOCKS if block.language == "python"]
BASH_BLOCKS = [block for block in BLOCKS if block.language in ("bash", "sh", "shell")]


def block_id(block: Block) -> str:
    return f"line{block.line}"


@dataclass(frozen=True)
class ServeCommand:
    """A ``# server:`` line as `start_server` arguments (the port is the test's to pick)."""

    target: str
    args: tuple[str, ...]
    workers: int

    @classmethod
    def parse(cls, line: str) -> ServeCommand:
        argv = shlex.split(line.removeprefix(SERVER_LINE))
        assert argv[:2] == ["gym-sessions", "serve"], f"not a serve command: {line}"
        target, rest = argv[2], argv[3:]
        args, workers = [], 1
        while rest:
            option = rest.pop(0)
            if option == "--workers":
                workers = int(rest.pop(0))
            elif option == "--port":
                rest.pop(0)  # the README's 8000; the test listens on a free port
            else:
                args.append(option)
        return cls(target, tuple(args), workers)


@pytest.fixture(scope="module")
def module_dir() -> Iterator[Path]:
    """A directory holding every ``# NAME.py`` module of the README."""
    with tempfile.TemporaryDirectory(prefix="gs-readme-", dir="/tmp") as path:
        for block in PYTHON_BLOCKS:
            match = MODULE_LINE.fullmatch(block.first_line)
            if match:
                (Path(path) / f"{match['module']}.py").write_text(block.code)
        yield Path(path)


def python_env(module_dir: Path) -> dict[str, str]:
    paths = [str(module_dir), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


@pytest.fixture(scope="module")
def server_for(module_dir: Path) -> Iterator[Callable[[ServeCommand], ServerProcess]]:
    """Start (once per module) the server a ``# server:`` line names; all stop at teardown."""
    started: dict[ServeCommand, ServerProcess] = {}

    def _server_for(command: ServeCommand) -> ServerProcess:
        if command not in started:
            started[command] = start_server(
                command.target, *command.args, workers=command.workers, env=python_env(module_dir)
            )
        return started[command]

    yield _server_for
    for server in started.values():
        server.stop()


def run_script(path: Path, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=SNIPPET_TIMEOUT,
        check=False,
    )


def test_the_readme_has_the_blocks_this_test_runs():
    # Guards the extraction: a broken fence pattern must not turn into "nothing to run".
    assert len(PYTHON_BLOCKS) >= 6
    assert sum(SERVER_LINE in block.first_line for block in PYTHON_BLOCKS) >= 4
    assert any("gym-sessions serve" in block.code for block in BASH_BLOCKS)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block_id(b) for b in PYTHON_BLOCKS])
def test_python_block_runs(block: Block, module_dir: Path, server_for, tmp_path: Path):
    module = MODULE_LINE.fullmatch(block.first_line)
    if module:
        command = [sys.executable, "-c", f"import {module['module']}"]
        result = subprocess.run(
            command,
            cwd=tmp_path,
            env=python_env(module_dir),
            capture_output=True,
            text=True,
            timeout=SNIPPET_TIMEOUT,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return
    if not block.first_line.startswith(SERVER_LINE):
        pytest.fail(
            f"README.md line {block.line}: a python block must start with "
            f"'{SERVER_LINE}gym-sessions serve ...' or '# NAME.py' (a module to save)"
        )
    assert README_URL in block.code, f"the snippet should talk to {README_URL}"
    for library, extra in EXTRA_LIBRARIES.items():
        if re.search(rf"^\s*(from|import) {library}\b", block.code, flags=re.MULTILINE):
            import_extra_or_skip(library, extra)
    server = server_for(ServeCommand.parse(block.first_line))
    script = tmp_path / f"readme_line{block.line}.py"
    script.write_text(block.code.replace(README_URL, server.url))
    result = run_script(script, module_dir, python_env(module_dir))
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "Traceback" not in result.stderr, result.stderr
    assert "Unclosed" not in result.stderr, result.stderr  # aiohttp's leak warnings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(pgid: int, grace: float) -> None:
    """Let the process group the test started end within ``grace`` s, then SIGTERM, SIGKILL it."""
    for sig, wait in ((None, grace), (signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        if not group_alive(pgid):
            return
        if sig is not None:
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.1)


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=[block_id(b) for b in BASH_BLOCKS])
def test_bash_block_runs(block: Block, short_tmp: str):
    ports = {port: str(free_port()) for port in set(re.findall(r"\b80\d\d\b", block.code))}
    code = re.sub(r"\b80\d\d\b", lambda match: ports[match.group()], block.code)
    script = Path(short_tmp) / "readme.sh"
    script.write_text(code)
    bin_dir = os.path.dirname(sys.executable)  # where pip put the gym-sessions command
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "TMPDIR": short_tmp}
    process = subprocess.Popen(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group, so its servers stop with it
    )
    stdout = stderr = ""
    finished = False
    try:
        stdout, stderr = process.communicate(timeout=SNIPPET_TIMEOUT)
        finished = True
    finally:
        # A finished script has stopped its servers; give them time to shut down.
        stop_group(process.pid, grace=20.0 if finished else 0.0)
        if process.poll() is None:
            process.communicate()
    assert process.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    for expected in re.findall(r"^# (\{.*?),\.\.\.\}$", block.code, flags=re.MULTILINE):
        assert expected in stdout, f"expected {expected!r} in:\n{stdout}\nstderr:\n{stderr}"
