"""Strict JSON parsing shared by the router and the routes: no NaN or Infinity literals."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["loads"]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def loads(raw: bytes | str) -> Any:
    """Parse ``raw``; raises `ValueError` for invalid JSON, NaN/Infinity or too-deep nesting."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc
