"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this venv's Python.

The notebooks are committed executed, with their outputs (plots included), so
that readers see them on GitHub; this test also checks that those outputs are
of the current code, that the servers a notebook starts are all gone once its
kernel has exited, and what each notebook must show (`SHOWS`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

import nbclient
import nbformat
import pytest
from jupyter_client.manager import KernelManager

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))
#: Set in the kernel's environment, so the servers it starts inherit it.
RUN_MARKER = "GYM_SESSIONS_NOTEBOOK_RUN"
#: Committed notebooks stay small enough to review and to render on GitHub.
MAX_NOTEBOOK_BYTES = 2_000_000


@pytest.fixture
def venv_kernel(tmp_path, monkeypatch) -> str:
    """A ``python3`` kernelspec that runs this interpreter, found before any other."""
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gym-sessions venv",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("SDL_VIDEODRIVER", "dummy")
    command = KernelManager(kernel_name="python3").format_kernel_cmd()
    assert os.path.realpath(command[0]) == os.path.realpath(sys.executable)
    return "python3"


def test_there_are_notebooks():
    names = {path.name for path in NOTEBOOKS}
    assert names >= {"rollouts.ipynb", "custom_env.ipynb", "agent_rollouts.ipynb"}
    for path in NOTEBOOKS:
        assert path.stat().st_size < MAX_NOTEBOOK_BYTES, path.name


def output_kinds(cell: nbformat.NotebookNode) -> set[str]:
    """What a code cell showed: ``stream:stdout``, ``display_data:image/png``, ... (no stderr).

    Kinds, not contents: URLs, worker ids and numbers change from run to run.
    """
    kinds = set()
    for output in cell.outputs:
        if output.output_type == "stream":
            if output.name != "stderr":  # warnings may come and go
                kinds.add(f"stream:{output.name}")
        elif output.output_type == "error":
            kinds.add("error")
        else:
            kinds.update(f"{output.output_type}:{mime}" for mime in output.get("data", {}))
    return kinds


def texts(cells: list[nbformat.NotebookNode], mime: str = "text/plain") -> list[str]:
    """Each cell's stdout (all its prints, in one text), and each ``mime`` of rich outputs."""
    found = []
    for cell in cells:
        streams = [o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout"]
        found.append("".join(streams))
        found.extend(o.data[mime] for o in cell.outputs if mime in o.get("data", {}))
    return found


def failure_line(cells: list[nbformat.NotebookNode]) -> str:
    """The agent notebook's count of failed runs (``10 of 40 runs failed: {...}``)."""
    (line,) = [m.group(0) for t in texts(cells) for m in re.finditer(r".* runs failed.*", t)]
    return line


def shows_rollouts(fresh: list[nbformat.NotebookNode], committed: list) -> None:
    for cells in (fresh, committed):
        # The episode's animation, as HTML with its frames embedded (no ffmpeg).
        assert any("_anim_" in html for html in texts(cells, "text/html"))
    # Every worker of the 4 is listed with its sessions, an idle one with 0.
    rows = [row for text in texts(fresh) for row in re.findall(r"^\d+-[0-9a-f]{8} .*$", text, re.M)]
    assert len(rows) == 4, rows


def shows_agent_rollouts(fresh: list[nbformat.NotebookNode], committed: list) -> None:
    for cells in (fresh, committed):
        assert sum('class="dataframe"' in html for html in texts(cells, "text/html")) >= 3
        failed, total = map(
            int, re.search(r"(\d+) of (\d+) runs failed", failure_line(cells)).groups()
        )
        assert 0 < failed < total
        shown = "".join(texts(cells))
        assert "wrong count" in shown and "502 error" in shown
        assert "bad_upstream" in shown  # a model reply without its tool call
    # Seeded tasks and a scripted model: the same runs fail every time.
    assert failure_line(fresh) == failure_line(committed)


#: What a notebook must show beyond running: called with its fresh and committed code cells.
SHOWS: dict[str, Callable[[list[nbformat.NotebookNode], list[nbformat.NotebookNode]], None]] = {
    "rollouts.ipynb": shows_rollouts,
    "agent_rollouts.ipynb": shows_agent_rollouts,
}


def marked_processes(marker: str) -> list[int]:
    """PIDs of processes (other than this one) whose environment holds ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as file:
                environment = file.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in environment:
            pids.append(int(entry))
    return pids


def settled(running: Callable[[], Collection[int]], within: float = 5.0) -> list[int]:
    """What ``running()`` still lists after waiting up to ``within`` s for it to empty."""
    deadline = time.monotonic() + within
    while (pids := running()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return sorted(pids)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs_and_is_committed_with_its_outputs(path, venv_kernel, tmp_path, monkeypatch):
    committed = nbformat.read(path, as_version=4)
    committed_cells = [cell for cell in committed.cells if cell.cell_type == "code"]
    # Committed executed top to bottom in one kernel, with no error, so GitHub shows the results.
    counts = [cell.execution_count for cell in committed_cells]
    assert counts == list(range(1, len(committed_cells) + 1)), counts
    assert all("error" not in output_kinds(cell) for cell in committed_cells)

    notebook = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    for cell in code_cells:
        cell.outputs, cell.execution_count = [], None
    run_id = uuid.uuid4().hex
    monkeypatch.setenv(RUN_MARKER, run_id)
    marker = f"{RUN_MARKER}={run_id}"
    last_cell = notebook.cells.index(code_cells[-1])
    kernel: list[int] = []  # the kernel's own process, marked before any cell runs
    running_after_last_cell: list[int] = []

    def before_cell(cell: nbformat.NotebookNode, cell_index: int) -> None:
        kernel[:] = kernel or marked_processes(marker)

    def after_cell(cell: nbformat.NotebookNode, cell_index: int, **_: object) -> None:
        if cell_index == last_cell:  # the notebook has stopped its servers by now
            running_after_last_cell[:] = settled(
                lambda: set(marked_processes(marker)) - set(kernel)
            )

    client = nbclient.NotebookClient(
        notebook,
        kernel_name=venv_kernel,
        timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},
        on_cell_execute=before_cell,
        on_cell_executed=after_cell,
    )
    try:
        client.execute()  # raises CellExecutionError naming the failing cell
    finally:
        # The kernel has been shut down: nothing it started may outlive it.
        left = settled(lambda: marked_processes(marker), within=20)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running after {path.name}'s kernel exited: {left}"
    assert not running_after_last_cell, (
        f"{path.name}'s last cell left processes running: {running_after_last_cell}"
    )
    errors = [
        output for cell in code_cells for output in cell.outputs if output.output_type == "error"
    ]
    assert not errors
    # The last cell stops the server it started.
    last = "".join(output.get("text", "") for output in code_cells[-1].outputs)
    assert "server exit code:" in last
    # The committed outputs are those of the current code: every cell shows the same
    # kinds of output now (re-run the notebooks as the README says when this fails).
    for index, (fresh, old) in enumerate(zip(code_cells, committed_cells, strict=True)):
        assert output_kinds(fresh) == output_kinds(old), f"code cell {index + 1}"
    if path.name in SHOWS:
        SHOWS[path.name](code_cells, committed_cells)
