"""The generated reference pages (docs/hooks/reference.py) cover the code they are made from."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from gym_sessions.settings import Settings

HOOK = Path(__file__).parents[1] / "docs" / "hooks" / "reference.py"


@pytest.fixture(scope="module")
def reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_reference", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_settings_field_has_a_docstring_entry(reference):
    documented = reference.settings_docs()
    fields = [field.name for field in dataclasses.fields(Settings)]
    assert [name for name in fields if not documented.get(name)] == []
    assert sorted(set(documented) - set(fields)) == []  # no entry for a field that is gone


def test_every_serve_option_fills_a_settings_field_or_is_known_to_be_serve_only(reference):
    fields = {field.name for field in dataclasses.fields(Settings)}
    serve = reference.subcommands()["serve"]
    for action in serve._actions:
        if action.dest in reference.SERVE_ONLY:
            continue
        assert reference.FLAG_FIELDS.get(action.dest, action.dest) in fields, action.dest


def test_the_settings_table_has_a_row_per_field_with_its_option(reference):
    table = reference.settings_markdown()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) == len(dataclasses.fields(Settings))
    assert "| `session_close_retry_window_seconds` | 300 s | `--window WINDOW` |" in table
    assert "| `max_body_bytes` | 16 MiB | `--max-body-bytes BYTES` |" in table
    assert "`--placement {balanced,local}`" in table
    assert "| `max_header_bytes` | 64 KiB | (Python only) |" in table


def test_the_cli_page_shows_every_subcommand_and_serve_option(reference):
    page = reference.cli_markdown()
    for name in ("serve", "reload", "status", "demo"):
        assert f"## gym-sessions {name}\n" in page
    for action in reference.subcommands()["serve"]._actions:
        if action.help != "==SUPPRESS==":
            for option in action.option_strings:
                assert option in page
    assert "--secret " not in page  # kept only to refuse it; never shown


def test_markers_are_replaced_and_other_lines_kept(reference):
    page = f"# Settings\n\ntext\n{reference.SETTINGS_MARKER}\nafter\n"
    out = reference.on_page_markdown(page)
    assert reference.SETTINGS_MARKER not in out
    assert out.startswith("# Settings\n\ntext\n| field |")
    assert out.endswith("after\n")


def test_every_docs_page_is_in_the_site_nav():
    # mkdocs --strict warns of pages left out of the nav; this says which, without mkdocs.
    root = Path(__file__).parents[1]
    nav = (root / "mkdocs.yml").read_text()
    pages = [
        str(path.relative_to(root / "docs"))
        for path in (root / "docs").rglob("*.md")
        if "hooks" not in path.parts
    ]
    assert [page for page in pages if f": {page}\n" not in nav] == []
