"""Griffe extension: read a Google docstring's ``Example:`` section as ``Examples:``.

The package's docstrings title their examples ``Example:``, as Gymnasium's
do; griffe's Google parser knows only the plural, and would render the
``>>>`` lines as nested quotes instead of code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:\s*$", flags=re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Rename each ``Example:`` section title to ``Examples:`` before the docstring is parsed."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
