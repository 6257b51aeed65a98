"""Every notebook in notebooks/ runs top to bottom in a fresh kernel of this venv's Python."""

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_notebook_runs_and_is_committed_without_outputs(path, venv_kernel, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code_cells)

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
