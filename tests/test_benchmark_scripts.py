"""Every script in ``benchmarks/`` still starts: ``--help``, as its command line runs it.

The benchmarks are run by hand, so nothing else notices when one stops
importing (every script that imported the client once failed at import: a
module of its folder shadowed one the package looks up). Each script runs in
an interpreter of its own, as ``python benchmarks/<script>`` does: whether a
shadowed import breaks depends on what was imported before it, so scripts
sharing one interpreter hid that very failure. About 20 s of CPU in all:
left to the full run (`make test-slow`, .ci/run).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: Scripts with a command line; ``_common.py`` and the like are helpers.
SCRIPTS = sorted(
    path.name
    for path in BENCHMARKS.glob("*.py")
    if not path.name.startswith("_") and 'if __name__ == "__main__":' in path.read_text()
)


def test_the_scripts_are_found_and_none_shadows_the_standard_library():
    assert len(SCRIPTS) >= 20 and "pooled_connection.py" in SCRIPTS
    # A script's folder is first on its path: a module named like the standard
    # library's would be imported in its place (`compression` is 3.14's).
    modules = {path.stem for path in BENCHMARKS.glob("*.py")}
    assert not modules & (set(sys.stdlib_module_names) | {"compression"})


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_script_starts(script):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"],
        cwd=BENCHMARKS.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage:"), result.stdout[:500]
