"""Reference pages generated from the code: the CLI's help and the `Settings` table.

MkDocs runs this file as a hook (``hooks:`` in mkdocs.yml): a page line that is
exactly one of the markers below is replaced by what the code says today, so
the reference cannot drift from ``gym-sessions --help`` or from
`gym_sessions.settings.Settings`. Run it alone to print a page's part::

    python docs/hooks/reference.py cli
    python docs/hooks/reference.py settings
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the checkout's package, not whatever is installed
    sys.path.insert(0, str(ROOT))

from gym_sessions import cli  # noqa: E402
from gym_sessions.settings import Settings  # noqa: E402

CLI_MARKER = "<!-- generated: cli-help -->"
SETTINGS_MARKER = "<!-- generated: settings-table -->"
#: Help is wrapped at this width whatever the terminal that builds the site.
HELP_COLUMNS = "100"

#: `serve` options whose argparse dest is not the `Settings` field they fill (cli.main).
FLAG_FIELDS = {
    "secret_file": "secret",
    "window": "session_close_retry_window_seconds",
    "no_routing": "routes_sessions_to_holder",
    "peer_network": "peer_networks",
    "metrics_token_file": "metrics_token",
    "allow_env": "allowed_envs",
    "allow_model": "allowed_models",
}
#: `serve` options that configure the command rather than a `Settings` field.
SERVE_ONLY = {"help", "target", "env_kwargs", "pid_file", "log_level", "command_line_secret"}
_MIB = 1024 * 1024


def subcommands() -> dict[str, argparse.ArgumentParser]:
    """The parser of each ``gym-sessions`` subcommand, in the order ``--help`` lists them."""
    parser = cli._parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise LookupError("gym-sessions has no subcommands")


def _help(parser: argparse.ArgumentParser) -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        return parser.format_help()
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous


def cli_markdown() -> str:
    """``gym-sessions --help`` and each subcommand's ``--help``, as Markdown."""
    parts = ["## gym-sessions", "", "```text", _help(cli._parser()).rstrip(), "```", ""]
    for name, parser in subcommands().items():
        parts += [f"## gym-sessions {name}", "", "```text", _help(parser).rstrip(), "```", ""]
    return "\n".join(parts)


def settings_docs() -> dict[str, str]:
    """Each field's text in the ``Attributes:`` section of the `Settings` docstring."""
    doc = Settings.__doc__ or ""
    section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
    entries: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        match = re.fullmatch(r" {8}(\w+): (.*)", line)
        if match:
            name = match[1]
            entries[name] = match[2].strip()
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


def serve_flags() -> dict[str, str]:
    """The `Settings` field each ``serve`` option fills, and the option as shown (``--x V``)."""
    flags: dict[str, str] = {}
    for action in subcommands()["serve"]._actions:
        if action.dest in SERVE_ONLY or not action.option_strings:
            continue
        field = FLAG_FIELDS.get(action.dest, action.dest)
        shown = action.option_strings[0]
        if action.choices:
            shown += " {" + ",".join(str(choice) for choice in action.choices) + "}"
        elif action.nargs != 0:
            shown += " " + (action.metavar or action.dest.upper())
        flags[field] = shown
    return flags


def _default(name: str, value: Any) -> str:
    if name == "secret":
        return f"`${cli.SECRET_ENV}`, else random per start"
    if isinstance(value, bool) or value is None:
        return f"`{value}`"
    if isinstance(value, int) and name.endswith("_bytes") and value >= 1024:
        return f"{value // _MIB} MiB" if value % _MIB == 0 else f"{value // 1024} KiB"
    if isinstance(value, float):
        return f"{value:g} s"
    if value in ("", ()):
        return "none"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, tuple):
        return ", ".join(f"`{item}`" for item in value)
    return str(value)


def _markdown_cell(text: str) -> str:
    text = re.sub(r"``(.+?)``", r"`\1`", text)  # reST literals to Markdown code
    return text.replace("|", "\\|")


def settings_markdown() -> str:
    """A table of every `Settings` field: default, the ``serve`` option, and its docstring."""
    docs, flags = settings_docs(), serve_flags()
    rows = ["| field | default | `serve` option | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(Settings):
        flag = f"`{flags[field.name]}`" if field.name in flags else "(Python only)"
        default = _default(field.name, field.default)
        rows.append(
            f"| `{field.name}` | {default} | {_markdown_cell(flag)} | "
            f"{_markdown_cell(docs.get(field.name, ''))} |"
        )
    return "\n".join(rows) + "\n"


GENERATED = {CLI_MARKER: cli_markdown, SETTINGS_MARKER: settings_markdown}


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs hook: replace each marker line with what it stands for."""
    lines = []
    for line in markdown.splitlines():
        generate = GENERATED.get(line.strip())
        lines.append(generate() if generate else line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else ""
    if which not in ("cli", "settings"):
        sys.exit("usage: python docs/hooks/reference.py cli|settings")
    print(cli_markdown() if which == "cli" else settings_markdown())
