"""What the description and value codecs share: their error and strict readers of JSON input.

Everything invalid coming in raises `SpaceCodecError`, a `ValueError`; the
public functions turn whatever numpy or gymnasium raise on malformed input
(`WRAPPED_ERRORS`) into it too, so a caller catches one class.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "WRAPPED_ERRORS",
    "SpaceCodecError",
    "handler_for",
    "int_from_json",
    "list_from_json",
]

# Exceptions that malformed input can provoke inside numpy or gymnasium.
WRAPPED_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    AssertionError,
    AttributeError,
    MemoryError,
    RecursionError,
)


class SpaceCodecError(ValueError):
    """A space description or value cannot be encoded or decoded."""


def int_from_json(data: Any, path: str) -> int:
    if type(data) is not int:
        raise SpaceCodecError(f"{path}: expected an integer, got {data!r:.40}")
    return data


def list_from_json(data: Any, path: str) -> list[Any]:
    if not isinstance(data, list):
        raise SpaceCodecError(f"{path}: expected a list, got {type(data).__name__}")
    return data


def handler_for(table: Mapping[type, Any], space: Any, path: str) -> Any:
    """The entry of ``table`` for ``space``'s class (or a supported base class of it)."""
    handler = table.get(type(space))
    if handler is not None:
        return handler
    for cls, handler in table.items():  # subclasses of the supported spaces
        if isinstance(space, cls):
            return handler
    raise SpaceCodecError(f"{path}: unsupported space {space!r:.80} ({type(space).__name__})")
