"""Values of spaces (observations, actions) as JSON: `value_to_json` and `value_from_json`.

A value's JSON mirrors the structure of its space: arrays become nested lists,
Discrete an int, Text a str, Tuple a list, Dict an object (keys in the space's
order), Sequence a list of its elements (for ``stack=True`` the per-element
encodings, which for array feature spaces is exactly ``stacked_array.tolist()``),
Graph an object with ``nodes``, ``edges`` and ``edge_links`` (``null`` where
absent; nodes and edges are encoded like a stacked Sequence), and OneOf
``[index, value]``. Numbers and non-finite floats are written as
`gym_sessions.spaces._arrays` says.

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

from gym_sessions.spaces._arrays import decode_array, encode_array
from gym_sessions.spaces._codec import (
    WRAPPED_ERRORS,
    SpaceCodecError,
    handler_for,
    int_from_json,
    list_from_json,
)

__all__ = ["space_contains", "to_jsonable", "value_from_json", "value_to_json"]

_ARRAY_SPACES = (Box, Discrete, MultiDiscrete, MultiBinary)


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
    assert isinstance(feature, Dict)  # `_has_no_length` holds only for Tuple and Dict
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
        return encode_array(arr, path)
    items = _unstack(feature, value, path)
    # A stacked value with no recorded length (e.g. for Sequence(Tuple(()), stack=True),
    # always ``()``) is written as [], which decodes back to that same value.
    return [_value_to_json(feature, item, f"{path}[{i}]") for i, item in enumerate(items or ())]


def _decode_stacked(feature: Space[Any], data: Any, path: str) -> Any:
    items = list_from_json(data, path)
    if isinstance(feature, _ARRAY_SPACES):
        return decode_array(items, feature.dtype, (len(items), *(feature.shape or ())), path)
    decoded = [_value_from_json(feature, item, f"{path}[{i}]") for i, item in enumerate(items)]
    out: Any = create_empty_array(feature, len(decoded))
    if not decoded:
        # `concatenate` cannot stack zero arrays (np.stack raises), but the empty
        # buffer already is the stacked form of no elements: shape-(0, ...) arrays.
        return out
    return concatenate(feature, decoded, out)


def _array_value_to_json(space: Any, value: Any, path: str) -> Any:
    return encode_array(value, path)


def _array_value_from_json(space: Any, data: Any, path: str) -> Any:
    return decode_array(data, space.dtype, space.shape, path)


def _discrete_value_to_json(space: Discrete, value: Any, path: str) -> int:
    try:
        return operator.index(value)
    except TypeError as exc:
        raise SpaceCodecError(f"{path}: expected an integer, got {value!r:.40}") from exc


def _discrete_value_from_json(space: Discrete, data: Any, path: str) -> Any:
    value = int_from_json(data, path)
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
    items = list_from_json(data, path)
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
        for i, item in enumerate(list_from_json(data, path))
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
        links = list_from_json(links, f"{path}.edge_links")
        links = decode_array(links, _EDGE_LINK_DTYPE, (len(links), 2), f"{path}.edge_links")
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
    items = list_from_json(data, path)
    if len(items) != 2:
        raise SpaceCodecError(f"{path}: expected [index, value]")
    index = _one_of_index(space, int_from_json(items[0], f"{path}[0]"), f"{path}[0]")
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
    encoder = _VALUE_ENCODERS.get(type(space)) or handler_for(_VALUE_ENCODERS, space, path)
    return encoder(space, value, path)


def _value_from_json(space: Space[Any], data: Any, path: str) -> Any:
    decoder = _VALUE_DECODERS.get(type(space)) or handler_for(_VALUE_DECODERS, space, path)
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
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: cannot encode value for {space!r:.80}: {exc!r}") from exc


def space_contains(space: Space[Any], value: Any) -> bool:
    """``space.contains(value)``, without numpy for a `Discrete` value `value_from_json` made.

    Gymnasium's ``Discrete.contains`` converts through numpy dtypes (about 5 us
    of a served ``/step``); for a scalar of the space's own dtype (what
    `value_from_json` gives) its answer is the range check alone.
    """
    if type(space) is Discrete and type(value) is space.dtype.type:
        start = int(space.start)
        return start <= int(value) < start + int(space.n)
    return bool(space.contains(value))


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
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: invalid value for {space!r:.80}: {exc!r}") from exc


def to_jsonable(value: Any) -> Any:
    """Data that has no space (an info dict, metadata) as JSON, the way replies carry it.

    Dicts (keys made strings), lists and tuples are walked; arrays become lists
    and numpy scalars Python scalars; a non-finite float becomes ``"inf"``,
    ``"-inf"`` or ``"nan"`` as in `value_to_json`; anything else is its ``repr``.
    Unlike `value_to_json` this cannot be undone exactly (a tuple comes back as a
    list, an array as nested lists): with a space, use `value_to_json`.

    Example:
        >>> to_jsonable({"x": np.float32(0.5), "hit": np.array([1, 2]), "t": (1, math.inf)})
        {'x': 0.5, 'hit': [1, 2], 't': [1, 'inf']}
    """
    if isinstance(value, dict):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(item) for item in value]
    if isinstance(value, np.ndarray):
        return to_jsonable(value.tolist())
    if isinstance(value, np.generic):
        return to_jsonable(value.item())
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return repr(value)
