"""Names a package exports but loads on first use (PEP 562), for what its workers never need."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    namespace: dict[str, Any], modules: Mapping[str, str], exported: Iterable[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` that load ``modules[name]`` on first use.

    Args:
        namespace: The package's ``globals()``: a loaded name is kept there,
            so the next use is a plain lookup.
        modules: Name -> the module that defines it.
        exported: The package's ``__all__`` (listed by ``dir`` before loading).
    """
    exported = tuple(exported)
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *exported})

    return __getattr__, __dir__
