"""Every fenced ``python`` and ``bash`` block of the docs runs as written.

The docs are README.md, CONTRIBUTING.md and every page under docs/. A Python
block's first line says what it is, so nothing is skipped silently:

- ``# NAME.py``: a module the page asks the reader to save. Every such
  module is written to one directory, which is on the import path of the
  servers and the snippets, and each is imported once in a fresh interpreter.
  Names are unique across all pages.
- ``# server: gym-sessions serve TARGET ARGS``: a script to run while that
  server listens on port 8000. The test starts the server (one per distinct
  command, shared by the whole module), replaces ``http://127.0.0.1:8000``
  with the server's URL and changes nothing else, runs the block as a script
  in a subprocess and expects exit status 0 and no traceback.
- ``# not run: REASON``: a sketch that needs what a test cannot have (a
  model to train, say); it is compiled, so its syntax is checked, and not run.

Any other Python block fails. A block that imports the library of an optional
extra (``stable_baselines3``: ``sb3``) skips with the install command when it
is missing, and fails on CI. A bash block starts its own servers: it runs
with its ports (8000-8099) moved to free ones, in a process group of its own
that is stopped by its id afterwards. Commands that must not run (``make
test``, a deployment's) are shown as indented code blocks, which this test
does not read.
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

ROOT = Path(__file__).parents[2]
#: The pages whose blocks run: the README, CONTRIBUTING.md and every page of the docs site.
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
SNIPPET_URL = "http://127.0.0.1:8000"
SERVER_LINE = "# server: "
NOT_RUN_LINE = "# not run: "
MODULE_LINE = re.compile(r"# (?P<module>[A-Za-z_]\w*)\.py")
SNIPPET_TIMEOUT = 180.0
#: Libraries of optional extras that snippets import, and their extras.
EXTRA_LIBRARIES = {"stable_baselines3": "sb3", "pandas": "pandas"}
#: Blocks that train a model (SB3's PPO): left out of the default run, as the SB3 tests are.
TRAINING_LIBRARIES = ("stable_baselines3",)


@dataclass(frozen=True)
class Block:
    """One fenced code block: its language, its page, the line it starts on, its code."""

    language: str
    page: str
    line: int
    code: str

    @property
    def first_line(self) -> str:
        return self.code.splitlines()[0] if self.code.strip() else ""


def fenced_blocks(text: str, page: str = "") -> list[Block]:
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
        blocks.append(Block(opening["language"], page, start, "\n".join(body) + "\n"))
        index += 1  # past the closing fence
    return blocks


BLOCKS = [
    block
    for page in PAGES
    if page.exists()
    for block in fenced_blocks(page.read_text(), str(page.relative_to(ROOT)))
]
PYTHON_BLOCKS = [block for block in BLOCKS if block.language == "python"]
BASH_BLOCKS = [block for block in BLOCKS if block.language in ("bash", "sh", "shell")]


def block_id(block: Block) -> str:
    return f"{block.page}:{block.line}"


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
                rest.pop(0)  # the page's 8000; the test listens on a free port
            else:
                args.append(option)
        return cls(target, tuple(args), workers)


@pytest.fixture(scope="module")
def module_dir() -> Iterator[Path]:
    """A directory holding every ``# NAME.py`` module of the pages."""
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


def test_the_pages_have_the_blocks_this_test_runs():
    # Guards the extraction: a broken fence pattern must not turn into "nothing to run".
    readme = [block for block in PYTHON_BLOCKS if block.page == "README.md"]
    assert sum(block.first_line.startswith(SERVER_LINE) for block in readme) >= 3
    assert sum(block.first_line.startswith(SERVER_LINE) for block in PYTHON_BLOCKS) >= 10
    assert sum(bool(MODULE_LINE.fullmatch(block.first_line)) for block in PYTHON_BLOCKS) >= 2
    assert any("gym-sessions serve" in block.code for block in BASH_BLOCKS)
    assert len({block.page for block in PYTHON_BLOCKS}) >= 5


def test_module_names_are_unique_across_pages():
    names = [
        match["module"]
        for block in PYTHON_BLOCKS
        if (match := MODULE_LINE.fullmatch(block.first_line))
    ]
    assert len(names) == len(set(names)), names


def _imports(block: Block, library: str) -> bool:
    return bool(re.search(rf"^\s*(from|import) {library}\b", block.code, flags=re.MULTILINE))


def _python_param(block: Block) -> object:
    trains = any(_imports(block, library) for library in TRAINING_LIBRARIES)
    return pytest.param(block, id=block_id(block), marks=[pytest.mark.slow] if trains else [])


@pytest.mark.parametrize("block", [_python_param(block) for block in PYTHON_BLOCKS])
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
    if block.first_line.startswith(NOT_RUN_LINE):
        assert block.first_line.removeprefix(NOT_RUN_LINE).strip(), "say why it is not run"
        compile(block.code, f"{block.page}:{block.line}", "exec")
        return
    if not block.first_line.startswith(SERVER_LINE):
        pytest.fail(
            f"{block.page} line {block.line}: a python block must start with "
            f"'{SERVER_LINE}gym-sessions serve ...', '# NAME.py' (a module to save) "
            f"or '{NOT_RUN_LINE}REASON'"
        )
    assert SNIPPET_URL in block.code, f"the snippet should talk to {SNIPPET_URL}"
    for library, extra in EXTRA_LIBRARIES.items():
        if _imports(block, library):
            import_extra_or_skip(library, extra)
    server = server_for(ServeCommand.parse(block.first_line))
    script = tmp_path / f"snippet_line{block.line}.py"
    script.write_text(block.code.replace(SNIPPET_URL, server.url))
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
    script = Path(short_tmp) / "snippet.sh"
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
