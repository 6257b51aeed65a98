"""Gymnasium space <-> JSON codec.

This module owns the JSON wire format for Gymnasium spaces and for the values
(elements) of those spaces. It is the only place that knows how a space is
described in JSON and how an observation or action is written to and read from JSON.

Space descriptions (`space_to_json` / `space_from_json`) are JSON objects with a
``"type"`` key; every other key is required unless noted:

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

Dtypes are numpy names (``"float32"``, ``"uint8"``, ``"bool"``); a dtype with a
non-native byte order uses numpy's ``dtype.str`` (e.g. ``">f4"``) instead. RNG
seeds are not part of a description.

JSON has no infinities or NaN, so a non-finite float, wherever a float can
appear (bounds, array elements), is written as one of the strings ``"inf"``,
``"-inf"`` or ``"nan"``. Every other float is written as a JSON number; float16
and float32 values are exactly representable as float64 and Python writes
floats in their shortest round-tripping form, so every value comes back
bit-exact (including ``-0.0``; the sign and payload of a NaN are not kept).

Values (`value_to_json` / `value_from_json`) mirror the structure of the space:
arrays become nested lists, Discrete an int, Text a str, Tuple a list, Dict an
object (keys in the space's order), Sequence a list of its elements (for
``stack=True`` the per-element encodings, which for array feature spaces is
exactly ``stacked_array.tolist()``), Graph an object with ``nodes``, ``edges``
and ``edge_links`` (``null`` where absent; nodes and edges are encoded like a
stacked Sequence), and OneOf ``[index, value]``.

A stacked value is split into its elements the way `concatenate` built it: a
Tuple/Dict part by part, arrays along the first axis, other spaces (Text,
Sequence, Graph, OneOf) as a tuple of elements. A part made only of empty
Tuples/Dicts (e.g. the ``Tuple(())`` in ``Sequence(Dict(a=Tuple(()), b=Box(...)),
stack=True)``) stacks to the same ``()`` for any length, so it is written as its
only element in every row and the length is taken from the other parts. If no
part records a length (``Sequence(Tuple(()), stack=True)``, whose values are all
``()``), the value is written as ``[]``, which decodes back to that same value.
An empty stacked value is ``[]`` and decodes to what ``create_empty_array(feature,
0)`` builds (e.g. ``{"b": np.zeros((0,), dtype)}``), for any feature space.

Everything invalid coming in raises `SpaceCodecError`, a `ValueError`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from gymnasium.spaces import (
    Box,
    Dict,
    Discrete,
    Graph,
    GraphInstance,
    MultiBinary,
    MultiDiscrete,
    OneOf,
    Sequence,
    Space,
    Text,
    Tuple,
)
from gymnasium.vector.utils import concatenate, create_empty_array

__all__ = [
    "SpaceCodecError",
    "space_from_json",
    "space_json_schema",
    "space_to_json",
    "value_from_json",
    "value_to_json",
]

#: Deepest nesting of composite spaces accepted in a description.
MAX_DESCRIPTION_DEPTH = 64
#: Largest number of elements a Box described by scalar bounds may expand to.
MAX_BOX_ELEMENTS = 2**27

_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}
_ARRAY_SPACES = (Box, Discrete, MultiDiscrete, MultiBinary)
# Exceptions that malformed input can provoke inside numpy or gymnasium.
_WRAPPED = (
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


# --------------------------------------------------------------------------- arrays


def _dtype_to_json(dtype: np.dtype[Any]) -> str:
    return dtype.name if dtype.isnative else dtype.str


def _dtype_from_json(data: Any, kinds: str, path: str) -> np.dtype[Any]:
    if not isinstance(data, str):
        raise SpaceCodecError(f"{path}: dtype must be a string, got {type(data).__name__}")
    try:
        dtype = np.dtype(data)
    except (TypeError, ValueError) as exc:
        raise SpaceCodecError(f"{path}: unknown dtype {data!r}") from exc
    if dtype.kind not in kinds or (dtype.kind == "f" and dtype.itemsize > 8):
        raise SpaceCodecError(f"{path}: dtype {data!r} is not allowed here")
    return dtype


def _encode_array(value: Any, path: str) -> Any:
    """Encode an array (or numpy/Python scalar) as nested lists of JSON scalars."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    kind = arr.dtype.kind
    if kind == "f":
        if arr.dtype.itemsize > 8:
            raise SpaceCodecError(f"{path}: dtype {arr.dtype} cannot be encoded exactly")
        if np.isfinite(arr).all():
            return arr.tolist()
        out = arr.astype(object)
        out[np.isnan(arr)] = "nan"
        out[np.isposinf(arr)] = "inf"
        out[np.isneginf(arr)] = "-inf"
        return out.tolist()
    if kind in "biu":
        return arr.tolist()
    raise SpaceCodecError(f"{path}: expected a numeric array, got dtype {arr.dtype}")


def _parse_float_tree(data: Any, depth: int, path: str) -> Any:
    """Replace the non-finite markers in nested lists by floats, checking leaf types."""
    if isinstance(data, (list, tuple)):
        if depth == 0:
            raise SpaceCodecError(f"{path}: array is nested too deep")
        return [_parse_float_tree(item, depth - 1, path) for item in data]
    kind = type(data)
    if kind is float or kind is int:
        return data
    if kind is str and data in _NONFINITE:
        return _NONFINITE[data]
    raise SpaceCodecError(
        f"{path}: expected a number or one of 'inf', '-inf', 'nan', got {data!r:.40}"
    )


def _cast_float(arr: np.ndarray, dtype: np.dtype[Any], path: str) -> np.ndarray:
    """Cast to a float dtype, refusing finite numbers that would overflow to inf."""
    if dtype.itemsize >= 8:
        return arr.astype(dtype, copy=False)
    try:
        with np.errstate(over="raise"):
            return arr.astype(dtype, copy=False)
    except FloatingPointError as exc:
        raise SpaceCodecError(f"{path}: number out of range for {dtype}") from exc


def _check_int_tree(data: Any, depth: int, path: str) -> None:
    """Check that nested lists hold only (non-bool) ints."""
    if isinstance(data, (list, tuple)):
        if depth == 0:
            raise SpaceCodecError(f"{path}: array is nested too deep")
        for item in data:
            _check_int_tree(item, depth - 1, path)
    elif type(data) is not int:
        raise SpaceCodecError(f"{path}: expected integers, got {data!r:.40}")


def _empty_shape_matches(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """Whether ``got`` is the shape numpy infers from ``np.zeros(want).tolist()``."""
    if 0 not in want:
        return False
    return got == want[: want.index(0) + 1]


def _decode_array(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], path: str) -> Any:
    """Decode nested lists into an array of exactly ``dtype`` and ``shape``."""
    try:
        arr = np.array(data)
    except (ValueError, TypeError, OverflowError) as exc:
        raise SpaceCodecError(f"{path}: not a rectangular numeric array ({exc})") from exc
    kind = arr.dtype.kind
    target = dtype.kind
    if arr.size == 0 and kind in "biuf":
        arr = arr.astype(dtype)
    elif target == "f":
        if kind in "fiu":
            arr = _cast_float(arr, dtype, path)
        elif kind in "UO":  # non-finite markers, or junk that the walk rejects
            tree = _parse_float_tree(data, len(shape), path)
            try:
                arr = np.array(tree, dtype=np.float64)
            except (ValueError, TypeError, OverflowError) as exc:
                raise SpaceCodecError(f"{path}: not a rectangular numeric array ({exc})") from exc
            arr = _cast_float(arr, dtype, path)
        else:
            raise SpaceCodecError(f"{path}: expected numbers, got {arr.dtype} data")
    elif target in "iu":
        if kind in "iu":
            info = np.iinfo(dtype)
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise SpaceCodecError(f"{path}: integer out of range for {dtype}")
            arr = arr.astype(dtype, copy=False)
        elif kind in "fO":
            # numpy infers float64 for e.g. [0, 2**64 - 1] (int64 and uint64 promote to
            # float), and object for ints beyond 64 bits: check the leaves are ints and
            # convert straight to the target dtype, which rejects out-of-range values.
            _check_int_tree(data, len(shape), path)
            try:
                arr = np.array(data, dtype=dtype)
            except (ValueError, TypeError, OverflowError) as exc:
                raise SpaceCodecError(f"{path}: integer out of range for {dtype}") from exc
        else:
            raise SpaceCodecError(f"{path}: expected integers, got {_describe_kind(kind)}")
    else:  # bool
        if kind != "b":
            raise SpaceCodecError(f"{path}: expected booleans, got {_describe_kind(kind)}")
        arr = arr.astype(dtype, copy=False)
    if arr.shape != shape:
        if arr.size == 0 and _empty_shape_matches(arr.shape, shape):
            return arr.reshape(shape)
        raise SpaceCodecError(f"{path}: expected shape {shape}, got {arr.shape}")
    return arr


def _describe_kind(kind: str) -> str:
    return {
        "b": "booleans",
        "f": "floats",
        "i": "integers",
        "u": "integers",
        "U": "strings",
    }.get(kind, "mixed or non-numeric data")


def _bound_to_json(arr: np.ndarray, path: str) -> Any:
    """Encode a bound array, as one scalar when every element is identical."""
    if arr.size:
        first = arr.reshape(-1)[0]
        same = arr == first
        if arr.dtype.kind == "f":
            same &= np.signbit(arr) == np.signbit(first)
        if same.all():
            return _encode_array(first, path)
    return _encode_array(arr, path)


def _bound_from_json(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], path: str) -> Any:
    if isinstance(data, list):
        return _decode_array(data, dtype, shape, path)
    return np.full(shape, _decode_array(data, dtype, (), path), dtype=dtype)


# --------------------------------------------------------------------- descriptions


def _check_keys(
    data: Any, keys: tuple[str, ...], path: str, optional: tuple[str, ...] = ()
) -> None:
    missing = [key for key in keys if key not in data]
    if missing:
        raise SpaceCodecError(f"{path}: {data['type']} description is missing {missing}")
    unknown = [key for key in data if key not in keys and key not in optional]
    if unknown:
        raise SpaceCodecError(f"{path}: {data['type']} description has unknown keys {unknown}")


def _int_from_json(data: Any, path: str) -> int:
    if type(data) is not int:
        raise SpaceCodecError(f"{path}: expected an integer, got {data!r:.40}")
    return data


def _bool_from_json(data: Any, path: str) -> bool:
    if type(data) is not bool:
        raise SpaceCodecError(f"{path}: expected true or false, got {data!r:.40}")
    return data


def _list_from_json(data: Any, path: str) -> list[Any]:
    if not isinstance(data, list):
        raise SpaceCodecError(f"{path}: expected a list, got {type(data).__name__}")
    return data


def _shape_from_json(data: Any, path: str) -> tuple[int, ...]:
    dims = tuple(
        _int_from_json(dim, f"{path}[{i}]") for i, dim in enumerate(_list_from_json(data, path))
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
        "dtype": _dtype_to_json(space.dtype),
        "shape": [int(dim) for dim in space.shape],
        "low": _bound_to_json(space.low, f"{path}.low"),
        "high": _bound_to_json(space.high, f"{path}.high"),
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
            data[key] = _bound_to_json(flags, f"{path}.{key}")
    return data


def _box_from_json(data: dict[str, Any], path: str, depth: int) -> Box:
    _check_keys(
        data,
        ("type", "dtype", "shape", "low", "high"),
        path,
        optional=("bounded_below", "bounded_above"),
    )
    dtype = _dtype_from_json(data["dtype"], "biuf", f"{path}.dtype")
    shape = _shape_from_json(data["shape"], f"{path}.shape")
    low = _bound_from_json(data["low"], dtype, shape, f"{path}.low")
    high = _bound_from_json(data["high"], dtype, shape, f"{path}.high")
    space = _construct(path, "Box", lambda: Box(low=low, high=high, shape=shape, dtype=dtype))
    bool_dtype = np.dtype(bool)
    if "bounded_below" in data:
        space.bounded_below = _bound_from_json(
            data["bounded_below"], bool_dtype, shape, f"{path}.bounded_below"
        )
    if "bounded_above" in data:
        space.bounded_above = _bound_from_json(
            data["bounded_above"], bool_dtype, shape, f"{path}.bounded_above"
        )
    return space


def _discrete_to_json(space: Discrete, path: str) -> dict[str, Any]:
    return {
        "type": "Discrete",
        "n": int(space.n),
        "start": int(space.start),
        "dtype": _dtype_to_json(space.dtype),
    }


def _discrete_from_json(data: dict[str, Any], path: str, depth: int) -> Discrete:
    _check_keys(data, ("type", "n", "start", "dtype"), path)
    n = _int_from_json(data["n"], f"{path}.n")
    start = _int_from_json(data["start"], f"{path}.start")
    dtype = _dtype_from_json(data["dtype"], "iu", f"{path}.dtype")
    return _construct(path, "Discrete", lambda: Discrete(n, start=start, dtype=dtype))


def _multi_discrete_to_json(space: MultiDiscrete, path: str) -> dict[str, Any]:
    return {
        "type": "MultiDiscrete",
        "dtype": _dtype_to_json(space.dtype),
        "shape": [int(dim) for dim in space.shape],
        "nvec": _encode_array(space.nvec, f"{path}.nvec"),
        "start": _encode_array(space.start, f"{path}.start"),
    }


def _multi_discrete_from_json(data: dict[str, Any], path: str, depth: int) -> MultiDiscrete:
    _check_keys(data, ("type", "dtype", "shape", "nvec", "start"), path)
    dtype = _dtype_from_json(data["dtype"], "iu", f"{path}.dtype")
    shape = _shape_from_json(data["shape"], f"{path}.shape")
    nvec = _decode_array(
        _list_from_json(data["nvec"], f"{path}.nvec"), dtype, shape, f"{path}.nvec"
    )
    start = _decode_array(
        _list_from_json(data["start"], f"{path}.start"), dtype, shape, f"{path}.start"
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
            _int_from_json(dim, f"{path}.n[{i}]") for i, dim in enumerate(raw)
        )
    else:
        n = _int_from_json(raw, f"{path}.n")
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
    min_length = _int_from_json(data["min_length"], f"{path}.min_length")
    max_length = _int_from_json(data["max_length"], f"{path}.max_length")
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
    items = _list_from_json(data["spaces"], f"{path}.spaces")
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
    for i, pair in enumerate(_list_from_json(data["spaces"], f"{path}.spaces")):
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
    except _WRAPPED as exc:
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


def _find(table: Mapping[type, Any], space: Any, path: str) -> Any:
    handler = table.get(type(space))
    if handler is not None:
        return handler
    for cls, handler in table.items():  # subclasses of the supported spaces
        if isinstance(space, cls):
            return handler
    raise SpaceCodecError(f"{path}: unsupported space {space!r:.80} ({type(space).__name__})")


def _space_to_json(space: Space[Any], path: str) -> dict[str, Any]:
    return _find(_SPACE_ENCODERS, space, path)(space, path)


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
    except _WRAPPED as exc:
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
    except _WRAPPED as exc:
        raise SpaceCodecError(f"$: invalid space description: {exc!r}") from exc


# --------------------------------------------------------------------------- values


def _has_no_length(feature: Space[Any]) -> bool:
    """Whether the stacked form of ``feature`` is the same for every length.

    `concatenate` stacks a Tuple/Dict part by part, so a Tuple or Dict built only
    from empty Tuples/Dicts (e.g. ``Tuple(())``) stacks to ``()``/``{}`` whatever
    the number of elements: it holds no per-element data, and no length.
    """
    if isinstance(feature, Tuple):
        return all(_has_no_length(sub) for sub in feature.spaces)
    if isinstance(feature, Dict):
        return all(_has_no_length(sub) for sub in feature.spaces.values())
    return False


def _only_element(feature: Space[Any]) -> Any:
    """The one element of a space for which `_has_no_length` holds."""
    if isinstance(feature, Tuple):
        return tuple(_only_element(sub) for sub in feature.spaces)
    return {key: _only_element(sub) for key, sub in feature.spaces.items()}


def _unstack(feature: Space[Any], value: Any, path: str) -> list[Any] | None:
    """Split a stacked value (as `concatenate` builds it) into its elements.

    Returns None when the stacked form does not record how many elements it
    holds (see `_has_no_length`); parts of a Tuple/Dict with no length take their
    only element in every row, and the length comes from the other parts.
    """
    if isinstance(feature, _ARRAY_SPACES):
        return list(np.asarray(value))
    if isinstance(feature, Tuple):
        if not isinstance(value, (tuple, list)) or len(value) != len(feature.spaces):
            raise SpaceCodecError(f"{path}: expected a stacked tuple of {len(feature.spaces)}")
        columns = [
            _unstack(sub, part, f"{path}[{i}]")
            for i, (sub, part) in enumerate(zip(feature.spaces, value, strict=True))
        ]
        rows = _join_columns(list(feature.spaces), columns, path)
        return None if rows is None else [tuple(row) for row in rows]
    if isinstance(feature, Dict):
        if not isinstance(value, Mapping) or set(value) != set(feature.spaces):
            raise SpaceCodecError(
                f"{path}: expected a stacked dict with keys {list(feature.spaces)}"
            )
        keys = list(feature.spaces)
        columns = [_unstack(feature.spaces[key], value[key], f"{path}[{key!r}]") for key in keys]
        rows = _join_columns(list(feature.spaces.values()), columns, path)
        return None if rows is None else [dict(zip(keys, row, strict=True)) for row in rows]
    return list(value)


def _join_columns(
    subs: list[Space[Any]], columns: list[list[Any] | None], path: str
) -> list[list[Any]] | None:
    """Turn per-part columns into rows; None if no part records the length."""
    lengths = {len(column) for column in columns if column is not None}
    if not lengths:
        return None
    if len(lengths) > 1:
        raise SpaceCodecError(f"{path}: stacked parts have different lengths")
    (n,) = lengths
    filled = [
        [_only_element(sub) for _ in range(n)] if column is None else column
        for sub, column in zip(subs, columns, strict=True)
    ]
    return [list(row) for row in zip(*filled, strict=True)]


def _encode_stacked(feature: Space[Any], value: Any, path: str) -> list[Any]:
    if isinstance(feature, _ARRAY_SPACES):
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.ndim == 0:
            raise SpaceCodecError(f"{path}: expected a stacked array, got a scalar")
        return _encode_array(arr, path)
    items = _unstack(feature, value, path)
    # A stacked value with no recorded length (e.g. for Sequence(Tuple(()), stack=True),
    # always ``()``) is written as [], which decodes back to that same value.
    return [_value_to_json(feature, item, f"{path}[{i}]") for i, item in enumerate(items or ())]


def _decode_stacked(feature: Space[Any], data: Any, path: str) -> Any:
    items = _list_from_json(data, path)
    if isinstance(feature, _ARRAY_SPACES):
        return _decode_array(items, feature.dtype, (len(items), *feature.shape), path)
    decoded = [_value_from_json(feature, item, f"{path}[{i}]") for i, item in enumerate(items)]
    out = create_empty_array(feature, len(decoded))
    if not decoded:
        # `concatenate` cannot stack zero arrays (np.stack raises), but the empty
        # buffer already is the stacked form of no elements: shape-(0, ...) arrays.
        return out
    return concatenate(feature, decoded, out)


def _array_value_to_json(space: Any, value: Any, path: str) -> Any:
    return _encode_array(value, path)


def _array_value_from_json(space: Any, data: Any, path: str) -> Any:
    return _decode_array(data, space.dtype, space.shape, path)


def _discrete_value_to_json(space: Discrete, value: Any, path: str) -> int:
    try:
        return operator.index(value)
    except TypeError as exc:
        raise SpaceCodecError(f"{path}: expected an integer, got {value!r:.40}") from exc


def _discrete_value_from_json(space: Discrete, data: Any, path: str) -> Any:
    value = _int_from_json(data, path)
    try:
        return space.dtype.type(value)
    except OverflowError as exc:
        raise SpaceCodecError(f"{path}: {value} is out of range for {space.dtype}") from exc


def _text_value_to_json(space: Text, value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise SpaceCodecError(f"{path}: expected a string, got {type(value).__name__}")
    return value


def _text_value_from_json(space: Text, data: Any, path: str) -> str:
    if not isinstance(data, str):
        raise SpaceCodecError(f"{path}: expected a string, got {type(data).__name__}")
    return data


def _tuple_value_to_json(space: Tuple, value: Any, path: str) -> list[Any]:
    if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
        raise SpaceCodecError(f"{path}: expected a tuple of {len(space.spaces)} values")
    return [
        _value_to_json(sub, part, f"{path}[{i}]")
        for i, (sub, part) in enumerate(zip(space.spaces, value, strict=True))
    ]


def _tuple_value_from_json(space: Tuple, data: Any, path: str) -> tuple[Any, ...]:
    items = _list_from_json(data, path)
    if len(items) != len(space.spaces):
        raise SpaceCodecError(f"{path}: expected {len(space.spaces)} values, got {len(items)}")
    return tuple(
        _value_from_json(sub, part, f"{path}[{i}]")
        for i, (sub, part) in enumerate(zip(space.spaces, items, strict=True))
    )


def _dict_value_to_json(space: Dict, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, Mapping) or value.keys() != space.spaces.keys():
        raise SpaceCodecError(f"{path}: expected a dict with keys {list(space.spaces)}")
    return {
        key: _value_to_json(sub, value[key], f"{path}[{key!r}]")
        for key, sub in space.spaces.items()
    }


def _dict_value_from_json(space: Dict, data: Any, path: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SpaceCodecError(f"{path}: expected an object, got {type(data).__name__}")
    if data.keys() != space.spaces.keys():
        missing = [key for key in space.spaces if key not in data]
        unknown = [key for key in data if key not in space.spaces]
        raise SpaceCodecError(f"{path}: missing keys {missing}, unknown keys {unknown}")
    return {
        key: _value_from_json(sub, data[key], f"{path}[{key!r}]")
        for key, sub in space.spaces.items()
    }


def _sequence_value_to_json(space: Sequence, value: Any, path: str) -> list[Any]:
    if space.stack:
        return _encode_stacked(space.feature_space, value, path)
    if not isinstance(value, (tuple, list)):
        raise SpaceCodecError(f"{path}: expected a tuple of values, got {type(value).__name__}")
    feature = space.feature_space
    return [_value_to_json(feature, item, f"{path}[{i}]") for i, item in enumerate(value)]


def _sequence_value_from_json(space: Sequence, data: Any, path: str) -> Any:
    if space.stack:
        return _decode_stacked(space.feature_space, data, path)
    feature = space.feature_space
    return tuple(
        _value_from_json(feature, item, f"{path}[{i}]")
        for i, item in enumerate(_list_from_json(data, path))
    )


def _graph_value_to_json(space: Graph, value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, GraphInstance):
        raise SpaceCodecError(f"{path}: expected a GraphInstance, got {type(value).__name__}")
    if value.nodes is None:
        raise SpaceCodecError(f"{path}.nodes: a graph needs nodes")
    edges = None
    if value.edges is not None:
        if space.edge_space is None:
            raise SpaceCodecError(f"{path}.edges: the space has no edge_space")
        edges = _encode_stacked(space.edge_space, value.edges, f"{path}.edges")
    links = None
    if value.edge_links is not None:
        links = np.asarray(value.edge_links)
        if links.dtype.kind not in "iu":
            raise SpaceCodecError(f"{path}.edge_links: expected integers, got {links.dtype}")
        links = links.tolist()
    return {
        "nodes": _encode_stacked(space.node_space, value.nodes, f"{path}.nodes"),
        "edges": edges,
        "edge_links": links,
    }


_EDGE_LINK_DTYPE = np.dtype(np.int32)  # what Graph.sample produces


def _graph_value_from_json(space: Graph, data: Any, path: str) -> GraphInstance:
    if not isinstance(data, dict):
        raise SpaceCodecError(f"{path}: expected an object, got {type(data).__name__}")
    unknown = [key for key in data if key not in ("nodes", "edges", "edge_links")]
    if unknown or "nodes" not in data:
        raise SpaceCodecError(f"{path}: expected keys nodes, edges, edge_links; got {list(data)}")
    nodes = _decode_stacked(space.node_space, data["nodes"], f"{path}.nodes")
    edges = data.get("edges")
    if edges is not None:
        if space.edge_space is None:
            raise SpaceCodecError(f"{path}.edges: the space has no edge_space")
        edges = _decode_stacked(space.edge_space, edges, f"{path}.edges")
    links = data.get("edge_links")
    if links is not None:
        links = _list_from_json(links, f"{path}.edge_links")
        links = _decode_array(links, _EDGE_LINK_DTYPE, (len(links), 2), f"{path}.edge_links")
    return GraphInstance(nodes, edges, links)


def _one_of_index(space: OneOf, index: Any, path: str) -> int:
    if not 0 <= index < len(space.spaces):
        raise SpaceCodecError(f"{path}: sub-space index {index} out of range")
    return index


def _one_of_value_to_json(space: OneOf, value: Any, path: str) -> list[Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise SpaceCodecError(f"{path}: expected an (index, value) pair")
    try:
        index = operator.index(value[0])
    except TypeError as exc:
        raise SpaceCodecError(f"{path}[0]: expected an integer index") from exc
    index = _one_of_index(space, index, f"{path}[0]")
    return [index, _value_to_json(space.spaces[index], value[1], f"{path}[1]")]


def _one_of_value_from_json(space: OneOf, data: Any, path: str) -> tuple[Any, Any]:
    items = _list_from_json(data, path)
    if len(items) != 2:
        raise SpaceCodecError(f"{path}: expected [index, value]")
    index = _one_of_index(space, _int_from_json(items[0], f"{path}[0]"), f"{path}[0]")
    return np.int64(index), _value_from_json(space.spaces[index], items[1], f"{path}[1]")


_VALUE_ENCODERS: dict[type, Callable[[Any, Any, str], Any]] = {
    Box: _array_value_to_json,
    Discrete: _discrete_value_to_json,
    MultiDiscrete: _array_value_to_json,
    MultiBinary: _array_value_to_json,
    Text: _text_value_to_json,
    Tuple: _tuple_value_to_json,
    Dict: _dict_value_to_json,
    Sequence: _sequence_value_to_json,
    Graph: _graph_value_to_json,
    OneOf: _one_of_value_to_json,
}

_VALUE_DECODERS: dict[type, Callable[[Any, Any, str], Any]] = {
    Box: _array_value_from_json,
    Discrete: _discrete_value_from_json,
    MultiDiscrete: _array_value_from_json,
    MultiBinary: _array_value_from_json,
    Text: _text_value_from_json,
    Tuple: _tuple_value_from_json,
    Dict: _dict_value_from_json,
    Sequence: _sequence_value_from_json,
    Graph: _graph_value_from_json,
    OneOf: _one_of_value_from_json,
}


def _value_to_json(space: Space[Any], value: Any, path: str) -> Any:
    encoder = _VALUE_ENCODERS.get(type(space)) or _find(_VALUE_ENCODERS, space, path)
    return encoder(space, value, path)


def _value_from_json(space: Space[Any], data: Any, path: str) -> Any:
    decoder = _VALUE_DECODERS.get(type(space)) or _find(_VALUE_DECODERS, space, path)
    return decoder(space, data, path)


def value_to_json(space: Space[Any], value: Any) -> Any:
    """Encode a value of ``space`` as JSON-serialisable data.

    Arrays become nested lists and numpy scalars Python scalars, exactly; a
    non-finite float becomes ``"inf"``, ``"-inf"`` or ``"nan"``. Membership in
    ``space`` is not checked.

    Args:
        space: The space the value belongs to.
        value: The value, in Gymnasium's native form.

    Returns:
        Plain JSON data that survives ``json.dumps(..., allow_nan=False)``.

    Raises:
        SpaceCodecError: The value does not have the structure of ``space``.
    """
    try:
        return _value_to_json(space, value, "$")
    except SpaceCodecError:
        raise
    except _WRAPPED as exc:
        raise SpaceCodecError(f"$: cannot encode value for {space!r:.80}: {exc!r}") from exc


def value_from_json(space: Space[Any], data: Any) -> Any:
    """Decode data made by `value_to_json` into a native value of ``space``.

    Box/MultiDiscrete/MultiBinary values come back as arrays of the space's
    dtype and shape, Discrete as a numpy integer of its dtype, Tuple and
    (unstacked) Sequence as tuples, Dict as a dict in the space's key order,
    Graph as a `GraphInstance` (edge links as int32, as ``Graph.sample`` makes
    them), OneOf as ``(np.int64(index), value)`` and Text as str. Membership in
    ``space`` is not checked; callers use ``space.contains`` for that. Array
    elements must be JSON numbers (or the non-finite strings, for float dtypes),
    booleans for bool dtypes; a finite number that overflows a float16/float32
    dtype is an error. For speed, arrays are parsed by numpy, so a ``true`` mixed
    into an otherwise numeric array is read as 1 rather than rejected.

    Args:
        space: The space the value belongs to.
        data: The encoded value (as parsed by ``json.loads``).

    Returns:
        The value in Gymnasium's native form.

    Raises:
        SpaceCodecError: The data is malformed (wrong shape, nesting or types).
    """
    try:
        return _value_from_json(space, data, "$")
    except SpaceCodecError:
        raise
    except _WRAPPED as exc:
        raise SpaceCodecError(f"$: invalid value for {space!r:.80}: {exc!r}") from exc


# --------------------------------------------------------------------------- JSON Schema


def _array_schema(shape: tuple[int, ...], item: dict[str, Any]) -> dict[str, Any]:
    schema = item
    for size in reversed(shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def _number_schema(kind: str, low: Any, high: Any) -> dict[str, Any]:
    if kind in "fc":
        # Non-finite values travel as the strings "inf", "-inf" and "nan".
        return {"anyOf": [{"type": "number"}, {"enum": list(_NONFINITE)}]}
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
