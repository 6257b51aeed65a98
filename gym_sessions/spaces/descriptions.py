"""Gymnasium spaces as JSON descriptions: `space_to_json` and `space_from_json`.

A description is a JSON object with a ``"type"`` key; every other key is
required unless noted:

* ``Box``: ``dtype``, ``shape``, ``low``, ``high`` and, only when they differ
  from what ``low``/``high`` imply, ``bounded_below`` / ``bounded_above``. A
  bound (or boundedness mask) that is the same everywhere is written as one scalar,
  otherwise as a nested list.
* ``Discrete``: ``n``, ``start``, ``dtype``.
* ``MultiDiscrete``: ``dtype``, ``shape``, ``nvec``, ``start``.
* ``MultiBinary``: ``n`` (an int, or a list of ints for a multi-axis space).
* ``Text``: ``min_length``, ``max_length``, ``charset`` (one string, in the
  space's character order).
* ``Tuple`` / ``OneOf``: ``spaces`` (a list of descriptions).
* ``Dict``: ``spaces`` (a list of ``[key, description]`` pairs, in key order).
* ``Sequence``: ``feature_space``, ``stack``.
* ``Graph``: ``node_space``, ``edge_space`` (``null`` when absent).

Dtypes, bounds and non-finite floats are written as `gym_sessions.spaces._arrays`
says. RNG seeds are not part of a description.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gymnasium.spaces import (
    Box,
    Dict,
    Discrete,
    Graph,
    MultiBinary,
    MultiDiscrete,
    OneOf,
    Sequence,
    Space,
    Text,
    Tuple,
)

from gym_sessions.spaces._arrays import (
    bound_from_json,
    bound_to_json,
    decode_array,
    dtype_from_json,
    dtype_to_json,
    encode_array,
)
from gym_sessions.spaces._codec import (
    WRAPPED_ERRORS,
    SpaceCodecError,
    handler_for,
    int_from_json,
    list_from_json,
)

__all__ = ["MAX_BOX_ELEMENTS", "MAX_DESCRIPTION_DEPTH", "space_from_json", "space_to_json"]

#: Deepest nesting of composite spaces accepted in a description.
MAX_DESCRIPTION_DEPTH = 64
#: Largest number of elements a Box described by scalar bounds may expand to.
MAX_BOX_ELEMENTS = 2**27


def _check_keys(
    data: Any, keys: tuple[str, ...], path: str, optional: tuple[str, ...] = ()
) -> None:
    missing = [key for key in keys if key not in data]
    if missing:
        raise SpaceCodecError(f"{path}: {data['type']} description is missing {missing}")
    unknown = [key for key in data if key not in keys and key not in optional]
    if unknown:
        raise SpaceCodecError(f"{path}: {data['type']} description has unknown keys {unknown}")


def _bool_from_json(data: Any, path: str) -> bool:
    if type(data) is not bool:
        raise SpaceCodecError(f"{path}: expected true or false, got {data!r:.40}")
    return data


def _shape_from_json(data: Any, path: str) -> tuple[int, ...]:
    dims = tuple(
        int_from_json(dim, f"{path}[{i}]") for i, dim in enumerate(list_from_json(data, path))
    )
    if any(dim < 0 for dim in dims):
        raise SpaceCodecError(f"{path}: shape dimensions must be non-negative, got {list(dims)}")
    if math.prod(dims) > MAX_BOX_ELEMENTS:
        raise SpaceCodecError(
            f"{path}: shape {list(dims)} has more than {MAX_BOX_ELEMENTS} elements"
        )
    return dims


def _box_to_json(space: Box, path: str) -> dict[str, Any]:
    data: dict[str, Any] = {
        "type": "Box",
        "dtype": dtype_to_json(space.dtype),
        "shape": [int(dim) for dim in space.shape],
        "low": bound_to_json(space.low, f"{path}.low"),
        "high": bound_to_json(space.high, f"{path}.high"),
    }
    # What `Box(low, high)` would infer from these bounds, to spot bounds that were
    # given as +-inf for an integer dtype (stored as the dtype limits, but unbounded).
    is_float = space.dtype.kind == "f"
    for key, flags, bound, inf in (
        ("bounded_below", space.bounded_below, space.low, -np.inf),
        ("bounded_above", space.bounded_above, space.high, np.inf),
    ):
        implied = bound != inf if is_float else np.ones(space.shape, dtype=bool)
        flags = np.asarray(flags, dtype=bool)
        if not np.array_equal(flags, implied):
            data[key] = bound_to_json(flags, f"{path}.{key}")
    return data


def _box_from_json(data: dict[str, Any], path: str, depth: int) -> Box:
    _check_keys(
        data,
        ("type", "dtype", "shape", "low", "high"),
        path,
        optional=("bounded_below", "bounded_above"),
    )
    dtype = dtype_from_json(data["dtype"], "biuf", f"{path}.dtype")
    shape = _shape_from_json(data["shape"], f"{path}.shape")
    low = bound_from_json(data["low"], dtype, shape, f"{path}.low")
    high = bound_from_json(data["high"], dtype, shape, f"{path}.high")
    space = _construct(path, "Box", lambda: Box(low=low, high=high, shape=shape, dtype=dtype))
    bool_dtype = np.dtype(bool)
    if "bounded_below" in data:
        space.bounded_below = bound_from_json(
            data["bounded_below"], bool_dtype, shape, f"{path}.bounded_below"
        )
    if "bounded_above" in data:
        space.bounded_above = bound_from_json(
            data["bounded_above"], bool_dtype, shape, f"{path}.bounded_above"
        )
    return space


def _discrete_to_json(space: Discrete, path: str) -> dict[str, Any]:
    return {
        "type": "Discrete",
        "n": int(space.n),
        "start": int(space.start),
        "dtype": dtype_to_json(space.dtype),
    }


def _discrete_from_json(data: dict[str, Any], path: str, depth: int) -> Discrete:
    _check_keys(data, ("type", "n", "start", "dtype"), path)
    n = int_from_json(data["n"], f"{path}.n")
    start = int_from_json(data["start"], f"{path}.start")
    dtype = dtype_from_json(data["dtype"], "iu", f"{path}.dtype")
    return _construct(path, "Discrete", lambda: Discrete(n, start=start, dtype=dtype))


def _multi_discrete_to_json(space: MultiDiscrete, path: str) -> dict[str, Any]:
    return {
        "type": "MultiDiscrete",
        "dtype": dtype_to_json(space.dtype),
        "shape": [int(dim) for dim in space.shape],
        "nvec": encode_array(space.nvec, f"{path}.nvec"),
        "start": encode_array(space.start, f"{path}.start"),
    }


def _multi_discrete_from_json(data: dict[str, Any], path: str, depth: int) -> MultiDiscrete:
    _check_keys(data, ("type", "dtype", "shape", "nvec", "start"), path)
    dtype = dtype_from_json(data["dtype"], "iu", f"{path}.dtype")
    shape = _shape_from_json(data["shape"], f"{path}.shape")
    nvec = decode_array(list_from_json(data["nvec"], f"{path}.nvec"), dtype, shape, f"{path}.nvec")
    start = decode_array(
        list_from_json(data["start"], f"{path}.start"), dtype, shape, f"{path}.start"
    )
    return _construct(path, "MultiDiscrete", lambda: MultiDiscrete(nvec, dtype=dtype, start=start))


def _multi_binary_to_json(space: MultiBinary, path: str) -> dict[str, Any]:
    n = space.n
    return {
        "type": "MultiBinary",
        "n": [int(dim) for dim in n] if isinstance(n, (tuple, list, np.ndarray)) else int(n),
    }


def _multi_binary_from_json(data: dict[str, Any], path: str, depth: int) -> MultiBinary:
    _check_keys(data, ("type", "n"), path)
    raw = data["n"]
    if isinstance(raw, list):
        n: int | tuple[int, ...] = tuple(
            int_from_json(dim, f"{path}.n[{i}]") for i, dim in enumerate(raw)
        )
    else:
        n = int_from_json(raw, f"{path}.n")
    return _construct(path, "MultiBinary", lambda: MultiBinary(n))


def _text_to_json(space: Text, path: str) -> dict[str, Any]:
    return {
        "type": "Text",
        "min_length": int(space.min_length),
        "max_length": int(space.max_length),
        "charset": "".join(space.character_list),
    }


def _text_from_json(data: dict[str, Any], path: str, depth: int) -> Text:
    _check_keys(data, ("type", "min_length", "max_length", "charset"), path)
    min_length = int_from_json(data["min_length"], f"{path}.min_length")
    max_length = int_from_json(data["max_length"], f"{path}.max_length")
    charset = data["charset"]
    if not isinstance(charset, str):
        raise SpaceCodecError(f"{path}.charset: expected a string, got {type(charset).__name__}")
    return _construct(
        path, "Text", lambda: Text(max_length, min_length=min_length, charset=charset)
    )


def _tuple_to_json(space: Tuple, path: str) -> dict[str, Any]:
    return {
        "type": "Tuple",
        "spaces": [
            _space_to_json(sub, f"{path}.spaces[{i}]") for i, sub in enumerate(space.spaces)
        ],
    }


def _subspaces_from_json(data: dict[str, Any], path: str, depth: int) -> list[Space[Any]]:
    _check_keys(data, ("type", "spaces"), path)
    items = list_from_json(data["spaces"], f"{path}.spaces")
    return [_space_from_json(sub, f"{path}.spaces[{i}]", depth + 1) for i, sub in enumerate(items)]


def _tuple_from_json(data: dict[str, Any], path: str, depth: int) -> Tuple:
    spaces = _subspaces_from_json(data, path, depth)
    return _construct(path, "Tuple", lambda: Tuple(spaces))


def _one_of_to_json(space: OneOf, path: str) -> dict[str, Any]:
    return {
        "type": "OneOf",
        "spaces": [
            _space_to_json(sub, f"{path}.spaces[{i}]") for i, sub in enumerate(space.spaces)
        ],
    }


def _one_of_from_json(data: dict[str, Any], path: str, depth: int) -> OneOf:
    spaces = _subspaces_from_json(data, path, depth)
    return _construct(path, "OneOf", lambda: OneOf(spaces))


def _dict_to_json(space: Dict, path: str) -> dict[str, Any]:
    pairs = []
    for key, sub in space.spaces.items():
        if not isinstance(key, str):
            raise SpaceCodecError(f"{path}: Dict keys must be strings, got {key!r}")
        pairs.append([key, _space_to_json(sub, f"{path}.spaces[{key!r}]")])
    return {"type": "Dict", "spaces": pairs}


def _dict_from_json(data: dict[str, Any], path: str, depth: int) -> Dict:
    _check_keys(data, ("type", "spaces"), path)
    pairs: dict[str, Space[Any]] = {}
    for i, pair in enumerate(list_from_json(data["spaces"], f"{path}.spaces")):
        item_path = f"{path}.spaces[{i}]"
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            raise SpaceCodecError(f"{item_path}: expected a [key, description] pair")
        key = pair[0]
        if key in pairs:
            raise SpaceCodecError(f"{item_path}: duplicate Dict key {key!r}")
        pairs[key] = _space_from_json(pair[1], f"{path}.spaces[{key!r}]", depth + 1)
    return _construct(path, "Dict", lambda: Dict(pairs, sort_keys=False))


def _sequence_to_json(space: Sequence, path: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "feature_space": _space_to_json(space.feature_space, f"{path}.feature_space"),
        "stack": bool(space.stack),
    }


def _sequence_from_json(data: dict[str, Any], path: str, depth: int) -> Sequence:
    _check_keys(data, ("type", "feature_space", "stack"), path)
    stack = _bool_from_json(data["stack"], f"{path}.stack")
    feature = _space_from_json(data["feature_space"], f"{path}.feature_space", depth + 1)
    return _construct(path, "Sequence", lambda: Sequence(feature, stack=stack))


def _graph_to_json(space: Graph, path: str) -> dict[str, Any]:
    edge_space = space.edge_space
    return {
        "type": "Graph",
        "node_space": _space_to_json(space.node_space, f"{path}.node_space"),
        "edge_space": None
        if edge_space is None
        else _space_to_json(edge_space, f"{path}.edge_space"),
    }


def _graph_from_json(data: dict[str, Any], path: str, depth: int) -> Graph:
    _check_keys(data, ("type", "node_space", "edge_space"), path)
    node_space = _space_from_json(data["node_space"], f"{path}.node_space", depth + 1)
    edge_space = (
        None
        if data["edge_space"] is None
        else _space_from_json(data["edge_space"], f"{path}.edge_space", depth + 1)
    )
    return _construct(path, "Graph", lambda: Graph(node_space, edge_space))


def _construct(path: str, kind: str, build: Callable[[], Any]) -> Any:
    """Run a gymnasium constructor, turning its complaints into `SpaceCodecError`."""
    try:
        return build()
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"{path}: invalid {kind} description: {exc}") from exc


_SPACE_ENCODERS: dict[type, Callable[[Any, str], dict[str, Any]]] = {
    Box: _box_to_json,
    Discrete: _discrete_to_json,
    MultiDiscrete: _multi_discrete_to_json,
    MultiBinary: _multi_binary_to_json,
    Text: _text_to_json,
    Tuple: _tuple_to_json,
    Dict: _dict_to_json,
    Sequence: _sequence_to_json,
    Graph: _graph_to_json,
    OneOf: _one_of_to_json,
}

_SPACE_DECODERS: dict[str, Callable[[dict[str, Any], str, int], Space[Any]]] = {
    "Box": _box_from_json,
    "Discrete": _discrete_from_json,
    "MultiDiscrete": _multi_discrete_from_json,
    "MultiBinary": _multi_binary_from_json,
    "Text": _text_from_json,
    "Tuple": _tuple_from_json,
    "Dict": _dict_from_json,
    "Sequence": _sequence_from_json,
    "Graph": _graph_from_json,
    "OneOf": _one_of_from_json,
}


def _space_to_json(space: Space[Any], path: str) -> dict[str, Any]:
    return handler_for(_SPACE_ENCODERS, space, path)(space, path)


def _space_from_json(data: Any, path: str, depth: int) -> Space[Any]:
    if depth > MAX_DESCRIPTION_DEPTH:
        raise SpaceCodecError(f"{path}: description nested deeper than {MAX_DESCRIPTION_DEPTH}")
    if not isinstance(data, dict):
        raise SpaceCodecError(
            f"{path}: expected a space description object, got {type(data).__name__}"
        )
    kind = data.get("type")
    decoder = _SPACE_DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise SpaceCodecError(
            f"{path}: unknown space type {kind!r}; expected one of {sorted(_SPACE_DECODERS)}"
        )
    return decoder(data, path, depth)


def space_to_json(space: Space[Any]) -> dict[str, Any]:
    """Describe a Gymnasium space as JSON-serialisable data.

    Args:
        space: A Box, Discrete, MultiDiscrete, MultiBinary, Text, Tuple, Dict,
            Sequence, Graph or OneOf space (nested arbitrarily).

    Returns:
        A dict of plain JSON types with a ``"type"`` key; it survives
        ``json.dumps(..., allow_nan=False)``.

    Raises:
        SpaceCodecError: The space (or a sub-space) has no JSON form, e.g. a
            custom Space class or a Dict with non-string keys.
    """
    try:
        return _space_to_json(space, "$")
    except SpaceCodecError:
        raise
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: cannot describe {space!r:.80}: {exc}") from exc


def space_from_json(data: Mapping[str, Any]) -> Space[Any]:
    """Rebuild a space from a description made by `space_to_json`.

    Args:
        data: The description (as parsed by ``json.loads``).

    Returns:
        A space equal to the described one, with the same dtype, shape, bounds,
        offsets, charset and sub-space order.

    Raises:
        SpaceCodecError: The description is unknown or malformed.
    """
    try:
        return _space_from_json(data, "$", 0)
    except SpaceCodecError:
        raise
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: invalid space description: {exc!r}") from exc
