"""The layering rules of docs/design.md §2 that `lint-imports` cannot see.

`lint-imports` (``make lint``, contracts in pyproject.toml) checks which
modules import which. These check what it does not: that no import of the
package hides in a function (where it hides a cycle from a reader and from
the contracts' graph alike), and that the examples use only the public API.
"""

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gym_sessions"

#: Commands import what they run only when they run it: ``gym-sessions --help``
#: must not load the server.
FUNCTION_IMPORTS_ALLOWED = {PACKAGE / "cli.py"}

#: What an example may import: the modules the docs' Python API and Settings
#: pages name, the wire names a raw-HTTP client spells, and the examples themselves.
PUBLIC_MODULES = {
    "gym_sessions",
    "gym_sessions.client",
    "gym_sessions.client.records",
    "gym_sessions.errors",
    "gym_sessions.integrations.sb3",
    "gym_sessions.integrations.trl",
    "gym_sessions.integrations.verl",
    "gym_sessions.server",
    "gym_sessions.settings",
    "gym_sessions.spaces",
    "gym_sessions.wire",
}


def _package_imports(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of gym_sessions (or relative import) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if node.level or module.split(".")[0] == "gym_sessions":
                found.append((node.lineno, module))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "gym_sessions"
            ]
    return found


def _function_level_imports(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Every import of the package inside a function (or method) of the module at ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(root)}:{line}: {module} (in {node.name})"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for line, module in _package_imports(node)
    ]


def test_no_module_imports_the_package_inside_a_function():
    paths = sorted(set(PACKAGE.rglob("*.py")) - FUNCTION_IMPORTS_ALLOWED)
    found = sorted({hit for path in paths for hit in _function_level_imports(path)})
    assert found == []


def test_the_check_sees_a_function_level_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import gym_sessions.errors\n\n"
        "def f():\n    from gym_sessions.routing import router\n\n"
        "class C:\n    async def g(self):\n        from . import sibling\n"
    )
    found = [hit.split(": ", 1)[1] for hit in _function_level_imports(module, tmp_path)]
    assert found == ["gym_sessions.routing (in f)", ". (in g)"]


def _example_sources() -> list[tuple[str, str]]:
    sources = [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted(ROOT.glob("envs/*.py"))]
    for notebook in sorted(ROOT.glob("notebooks/*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        for index, cell in enumerate(cells):
            if cell["cell_type"] == "code":
                code = "".join(cell["source"])
                # IPython's magics and shell escapes are not Python.
                code = "\n".join(
                    "" if line.lstrip().startswith(("%", "!")) else line
                    for line in code.splitlines()
                )
                sources.append((f"{notebook.relative_to(ROOT)} cell {index}", code))
    return sources


@pytest.mark.parametrize(("where", "source"), _example_sources(), ids=lambda v: str(v)[:60])
def test_examples_use_only_the_public_api(where, source):
    internal = [
        f"{line}: {module}"
        for line, module in _package_imports(ast.parse(source))
        if not (
            module.startswith(".")  # another example
            or module in PUBLIC_MODULES
            or module.startswith("gym_sessions.examples.")
        )
    ]
    assert internal == [], where
