"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this venv's Python.

The notebooks are committed executed, with their outputs (plots included), so
that readers see them on GitHub; this test also checks that those outputs are
of the current code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbclient
import nbformat
import pytest
from jupyter_client.manager import KernelManager

pytestmark = pytest.mark.e2e

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


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
    assert {path.name for path in NOTEBOOKS} >= {"rollouts.ipynb", "custom_env.ipynb"}


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs_and_is_committed_with_its_outputs(path, venv_kernel, tmp_path):
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
    client = nbclient.NotebookClient(
        notebook,
        kernel_name=venv_kernel,
        timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
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
