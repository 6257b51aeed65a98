"""Strict JSON parsing shared by the router and the routes: no NaN or Infinity literals."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads", "reject_constant"]


def reject_constant(name: str) -> Any:
    """A decoder's ``parse_constant``: NaN and Infinity literals are not JSON."""
    raise ValueError(f"{name} is not valid JSON")


# Made once: ``json.loads`` with any option builds a new decoder (and scanner) per call.
_DECODER = json.JSONDecoder(parse_constant=reject_constant)


def loads(raw: bytes | str) -> Any:
    """Parse ``raw``; raises `ValueError` for invalid JSON, NaN/Infinity or too-deep nesting.

    Bytes are decoded as ``json.loads`` decodes them (UTF-8, -16 or -32, found
    from the first bytes; a UTF-8 BOM is allowed), and a text that starts with
    a BOM is refused as it refuses it.
    """
    if isinstance(raw, bytes | bytearray):
        raw = raw.decode(json.detect_encoding(raw), "surrogatepass")
    elif raw.startswith("\ufeff"):
        raise ValueError("Unexpected UTF-8 BOM (decode using utf-8-sig)")
    try:
        return _DECODER.decode(raw)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
