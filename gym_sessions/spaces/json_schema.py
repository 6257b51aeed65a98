"""JSON Schema for the JSON values of a space: `space_json_schema` (tool parameters)."""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium.spaces import Box, Dict, Discrete, MultiBinary, MultiDiscrete, Space, Text, Tuple

from gym_sessions.spaces._arrays import NONFINITE

__all__ = ["space_json_schema"]


def _array_schema(shape: tuple[int, ...], item: dict[str, Any]) -> dict[str, Any]:
    schema = item
    for size in reversed(shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def _number_schema(kind: str, low: Any, high: Any) -> dict[str, Any]:
    if kind in "fc":
        # Non-finite values travel as the strings "inf", "-inf" and "nan".
        return {"anyOf": [{"type": "number"}, {"enum": list(NONFINITE)}]}
    if kind == "b":
        return {"type": "boolean"}
    schema: dict[str, Any] = {"type": "integer"}
    if np.ndim(low) == 0 and np.ndim(high) == 0:
        schema.update(minimum=int(low), maximum=int(high))
    return schema


def space_json_schema(space: Space[Any]) -> dict[str, Any]:
    """A JSON Schema for the JSON encoding (`value_to_json`) of values of ``space``.

    Used to describe actions to agents (MCP tool inputs). Exact for Discrete,
    MultiBinary, Text, Tuple and Dict; Box and MultiDiscrete give shape and item
    type, with bounds when they are the same for every element. Other spaces
    accept any JSON.
    """
    if isinstance(space, Discrete):
        start = int(space.start)
        return {"type": "integer", "minimum": start, "maximum": start + int(space.n) - 1}
    if isinstance(space, Box):
        low = space.low.flat[0] if np.all(space.low == space.low.flat[0]) else space.low
        high = space.high.flat[0] if np.all(space.high == space.high.flat[0]) else space.high
        item = _number_schema(space.dtype.kind, low, high)
        if space.dtype.kind in "fc" and np.ndim(low) == 0 and np.ndim(high) == 0:
            bounds = {}
            if np.isfinite(low):
                bounds["minimum"] = float(low)
            if np.isfinite(high):
                bounds["maximum"] = float(high)
            item = {"type": "number", **bounds} if bounds else item
        return _array_schema(space.shape, item)
    if isinstance(space, MultiDiscrete):
        return _array_schema(space.shape, {"type": "integer"})
    if isinstance(space, MultiBinary):
        return _array_schema(space.shape, {"type": "integer", "enum": [0, 1]})
    if isinstance(space, Text):
        return {
            "type": "string",
            "minLength": int(space.min_length),
            "maxLength": int(space.max_length),
        }
    if isinstance(space, Tuple):
        items = [space_json_schema(sub) for sub in space.spaces]
        return {
            "type": "array",
            "prefixItems": items,
            "minItems": len(items),
            "maxItems": len(items),
        }
    if isinstance(space, Dict):
        return {
            "type": "object",
            "properties": {key: space_json_schema(sub) for key, sub in space.spaces.items()},
            "required": list(space.spaces),
            "additionalProperties": False,
        }
    return {}
