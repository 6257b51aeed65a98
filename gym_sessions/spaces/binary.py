"""Values of spaces in binary: a small JSON tree plus the arrays' raw bytes.

A value's binary form (docs/design.md §3.15) is its *tree* and its *buffers*
(`value_to_tree`). The tree mirrors the value as `gym_sessions.spaces.values`
writes it in JSON, except that every array (a Box, MultiBinary or
MultiDiscrete value, a stacked Sequence of array features, Graph nodes, edges
and edge links) is a reference ``{"buffer": i, "dtype": "<f4", "shape": [84,
84]}`` to buffer ``i``. Discrete values stay JSON integers, Text values
strings. On the wire the trees sit in a message's head and the buffers are its
blobs (`gym_sessions.value_messages`); a *segment* (`value_to_segment`) frames
one value alone, its tree as the head.

A frame (the same layout for a segment and for a whole message)::

    u32 LE  head length H
    u32 LE  blob count N
    N x u64 LE  blob lengths
    H bytes head (UTF-8 JSON)
    then each blob, starting at the next offset that is a multiple of 8
    (zero padding), the frame ending right after the last blob

Decoding checks everything against the space: the declared dtype must be the
space's dtype (``numpy.dtype.str``, so the byte order is explicit), the shape
the space's shape (a stacked value: any number of rows of it), the buffer
exactly ``prod(shape) * itemsize`` bytes (bool bytes 0 or 1), and every buffer
backs exactly one array. Arrays come back as ``np.frombuffer`` views of the
received bytes: no copy (read-only views of ``bytes``).
"""

from __future__ import annotations

import collections.abc
import functools
import json
import math
import operator
import struct
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

from gym_sessions import strict_json
from gym_sessions.spaces._arrays import _cast_float
from gym_sessions.spaces._codec import WRAPPED_ERRORS, SpaceCodecError, handler_for
from gym_sessions.spaces.values import (
    _discrete_value_from_json,
    _discrete_value_to_json,
    _one_of_index,
    _unstack,
)

__all__ = [
    "MAX_BLOBS",
    "Buffer",
    "frame",
    "unframe",
    "value_from_segment",
    "value_from_tree",
    "value_to_segment",
    "value_to_tree",
]

#: Blobs one frame may hold (a message's segments, a segment's arrays).
MAX_BLOBS = 65536
_MAX_NDIM = 32
_ARRAY_SPACES = (Box, Discrete, MultiDiscrete, MultiBinary)
_EDGE_LINK_DTYPE = np.dtype(np.int32)
_U32 = struct.Struct("<II")
_REF_KEYS = frozenset({"buffer", "dtype", "shape"})

#: What a blob or an array's buffer may be.
Buffer = bytes | bytearray | memoryview


@functools.lru_cache(maxsize=64)
def _lengths(count: int) -> struct.Struct:
    """The blob table of ``count`` blobs (compiled once per count in use)."""
    return struct.Struct(f"<{count}Q")


_ZEROS = [b"\0" * n for n in range(8)]
_STRICT = json.JSONDecoder(parse_constant=strict_json.reject_constant)


def _head(text: str) -> Any:
    """``strict_json.loads(text)``; a compact head (what writers send) in one C call."""
    if text[:1] in "{[" and text:
        try:
            value, end = _STRICT.raw_decode(text)
        except RecursionError as exc:
            raise ValueError("JSON nested too deeply") from exc
        if end == len(text):
            return value
    return strict_json.loads(text)  # whitespace around the value, or its error


def frame(head: bytes, blobs: collections.abc.Sequence[bytes | bytearray | memoryview]) -> bytes:
    """One frame of ``head`` (JSON bytes) and ``blobs`` (see the module)."""
    count = len(blobs)
    if not count:
        return _U32.pack(len(head), 0) + head
    lengths = [len(blob) for blob in blobs]
    parts: list[bytes | bytearray | memoryview] = [
        _U32.pack(len(head), count),
        _lengths(count).pack(*lengths),
        head,
    ]
    offset = 8 + 8 * count + len(head)
    for blob, length in zip(blobs, lengths, strict=True):
        pad = -offset & 7
        if pad:
            parts.append(_ZEROS[pad])
        parts.append(blob)
        offset += pad + length
    return b"".join(parts)


def unframe(data: memoryview, what: str) -> tuple[Any, list[memoryview]]:
    """The parsed JSON head and the blobs (views of ``data``) of one frame."""
    size = len(data)
    if size < 8:
        raise SpaceCodecError(f"{what}: truncated frame ({size} bytes)")
    head_len, count = _U32.unpack_from(data, 0)
    if count > MAX_BLOBS:
        raise SpaceCodecError(f"{what}: {count} blobs, at most {MAX_BLOBS}")
    table_end = 8 + 8 * count
    offset = table_end + head_len
    if offset > size:
        raise SpaceCodecError(f"{what}: the frame is shorter than its head says")
    try:
        head = _head(str(data[table_end:offset], "utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise SpaceCodecError(f"{what}: head is not valid UTF-8 JSON: {exc}") from exc
    blobs = []
    if count:
        for length in _lengths(count).unpack_from(data, 8):
            offset += -offset & 7
            end = offset + length
            if end > size:
                raise SpaceCodecError(f"{what}: the frame is shorter than its blob table says")
            blobs.append(data[offset:end])
            offset = end
    if offset != size:
        raise SpaceCodecError(f"{what}: {size - offset} bytes after the last blob")
    return head, blobs


# Encoding -------------------------------------------------------------------------------------


def _exact(arr: np.ndarray, dtype: np.dtype[Any], path: str) -> np.ndarray:
    """``arr`` as ``dtype``, refusing what the JSON codec refuses (a lossy or wrapping cast)."""
    if arr.dtype == dtype:
        return arr
    kind, target = arr.dtype.kind, dtype.kind
    if target == "f" and kind in "fiub":
        return _cast_float(arr, dtype, path)
    if target in "iu" and kind in "iu":
        info = np.iinfo(dtype)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise SpaceCodecError(f"{path}: integer out of range for {dtype}")
        return arr.astype(dtype)
    if target == kind == "b":
        return arr.astype(dtype)
    raise SpaceCodecError(f"{path}: cannot send {arr.dtype} data as {dtype}")


class _Writer:
    def __init__(self) -> None:
        self.buffers: list[bytes | bytearray | memoryview] = []

    def array(self, value: Any, dtype: np.dtype[Any], path: str) -> dict[str, Any]:
        arr = value if isinstance(value, np.ndarray) else np.asarray(value)
        if arr.dtype.kind not in "biuf" or (arr.dtype.kind == "f" and arr.dtype.itemsize > 8):
            raise SpaceCodecError(f"{path}: expected a numeric array, got dtype {arr.dtype}")
        arr = _exact(arr, dtype, path)
        if not arr.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
            arr = arr.copy(order="C")
        self.buffers.append(arr.data.cast("B") if arr.size else b"")
        return {"buffer": len(self.buffers) - 1, "dtype": dtype.str, "shape": list(arr.shape)}

    def value(self, space: Space[Any], value: Any, path: str) -> Any:
        encoder = _ENCODERS.get(type(space)) or handler_for(_ENCODERS, space, path)
        return encoder(self, space, value, path)

    def stacked(self, feature: Space[Any], value: Any, path: str) -> Any:
        if isinstance(feature, _ARRAY_SPACES):
            arr = value if isinstance(value, np.ndarray) else np.asarray(value)
            if arr.ndim == 0:
                raise SpaceCodecError(f"{path}: expected a stacked array, got a scalar")
            return self.array(arr, feature.dtype, path)
        items = _unstack(feature, value, path)
        return [self.value(feature, item, f"{path}[{i}]") for i, item in enumerate(items or ())]


def _enc_array(w: _Writer, space: Any, value: Any, path: str) -> Any:
    ref = w.array(value, space.dtype, path)
    if tuple(ref["shape"]) != space.shape:
        raise SpaceCodecError(f"{path}: expected shape {space.shape}, got {tuple(ref['shape'])}")
    return ref


def _enc_discrete(w: _Writer, space: Discrete, value: Any, path: str) -> Any:
    return _discrete_value_to_json(space, value, path)


def _enc_text(w: _Writer, space: Text, value: Any, path: str) -> Any:
    if not isinstance(value, str):
        raise SpaceCodecError(f"{path}: expected a string, got {type(value).__name__}")
    return value


def _enc_tuple(w: _Writer, space: Tuple, value: Any, path: str) -> Any:
    if not isinstance(value, (tuple, list)) or len(value) != len(space.spaces):
        raise SpaceCodecError(f"{path}: expected a tuple of {len(space.spaces)} values")
    return [
        w.value(sub, part, f"{path}[{i}]")
        for i, (sub, part) in enumerate(zip(space.spaces, value, strict=True))
    ]


def _enc_dict(w: _Writer, space: Dict, value: Any, path: str) -> Any:
    if not isinstance(value, Mapping) or value.keys() != space.spaces.keys():
        raise SpaceCodecError(f"{path}: expected a dict with keys {list(space.spaces)}")
    return {key: w.value(sub, value[key], f"{path}[{key!r}]") for key, sub in space.spaces.items()}


def _enc_sequence(w: _Writer, space: Sequence, value: Any, path: str) -> Any:
    if space.stack:
        return w.stacked(space.feature_space, value, path)
    if not isinstance(value, (tuple, list)):
        raise SpaceCodecError(f"{path}: expected a tuple of values, got {type(value).__name__}")
    return [w.value(space.feature_space, item, f"{path}[{i}]") for i, item in enumerate(value)]


def _enc_graph(w: _Writer, space: Graph, value: Any, path: str) -> Any:
    if not isinstance(value, GraphInstance):
        raise SpaceCodecError(f"{path}: expected a GraphInstance, got {type(value).__name__}")
    if value.nodes is None:
        raise SpaceCodecError(f"{path}.nodes: a graph needs nodes")
    edges = links = None
    if value.edges is not None:
        if space.edge_space is None:
            raise SpaceCodecError(f"{path}.edges: the space has no edge_space")
        edges = w.stacked(space.edge_space, value.edges, f"{path}.edges")
    if value.edge_links is not None:
        arr = np.asarray(value.edge_links)
        if arr.dtype.kind not in "iu":
            raise SpaceCodecError(f"{path}.edge_links: expected integers, got {arr.dtype}")
        links = w.array(arr, _EDGE_LINK_DTYPE, f"{path}.edge_links")
    return {
        "nodes": w.stacked(space.node_space, value.nodes, f"{path}.nodes"),
        "edges": edges,
        "edge_links": links,
    }


def _enc_one_of(w: _Writer, space: OneOf, value: Any, path: str) -> Any:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise SpaceCodecError(f"{path}: expected an (index, value) pair")
    try:
        index = operator.index(value[0])
    except TypeError as exc:
        raise SpaceCodecError(f"{path}[0]: expected an integer index") from exc
    index = _one_of_index(space, index, f"{path}[0]")
    return [index, w.value(space.spaces[index], value[1], f"{path}[1]")]


_ENCODERS: dict[type, Callable[[_Writer, Any, Any, str], Any]] = {
    Box: _enc_array,
    Discrete: _enc_discrete,
    MultiDiscrete: _enc_array,
    MultiBinary: _enc_array,
    Text: _enc_text,
    Tuple: _enc_tuple,
    Dict: _enc_dict,
    Sequence: _enc_sequence,
    Graph: _enc_graph,
    OneOf: _enc_one_of,
}


# Decoding -------------------------------------------------------------------------------------


def _is_shape(dims: tuple[Any, ...]) -> bool:
    """Whether ``dims`` can be a numpy shape: at most 32 ints >= 0 (no bools)."""
    return len(dims) <= _MAX_NDIM and all(type(d) is int and d >= 0 for d in dims)


class _Reader:
    def __init__(self, buffers: collections.abc.Sequence[Buffer]) -> None:
        self.buffers = buffers
        # Each buffer backs one array: a buffer named twice would let a few
        # bytes stand for many arrays' worth of elements, which JSON cannot.
        self.named = bytearray(len(buffers))
        self.unnamed = len(buffers)

    def array(
        self, ref: Any, dtype: np.dtype[Any], shape: tuple[int, ...] | None, path: str
    ) -> Any:
        """The array ``ref`` points at; ``shape`` None: any number of rows (given separately)."""
        if type(ref) is not dict or ref.keys() != _REF_KEYS:
            raise SpaceCodecError(f"{path}: expected an array reference {{buffer, dtype, shape}}")
        index, declared, dims = ref["buffer"], ref["dtype"], ref["shape"]
        if type(index) is not int or not 0 <= index < len(self.buffers):
            raise SpaceCodecError(f"{path}: buffer {index!r:.20} does not exist")
        if self.named[index]:
            raise SpaceCodecError(f"{path}: buffer {index} is named twice")
        self.named[index] = 1
        self.unnamed -= 1
        if declared != dtype.str:
            raise SpaceCodecError(f"{path}: dtype {declared!r:.20} is not the space's {dtype.str}")
        got = tuple(dims) if type(dims) is list else None
        if got is None or not _is_shape(got):
            raise SpaceCodecError(f"{path}: shape must be a list of non-negative integers")
        if shape is not None and got != shape:
            raise SpaceCodecError(f"{path}: expected shape {shape}, got {got}")
        buffer = self.buffers[index]
        if math.prod(got) * dtype.itemsize != len(buffer):
            raise SpaceCodecError(
                f"{path}: shape {got} of {dtype.str} needs {math.prod(got) * dtype.itemsize}"
                f" bytes, the buffer holds {len(buffer)}"
            )
        if dtype.kind == "b" and len(buffer) and np.frombuffer(buffer, np.uint8).max() > 1:
            raise SpaceCodecError(f"{path}: a bool array holds a byte other than 0 or 1")
        return np.frombuffer(buffer, dtype=dtype).reshape(got)

    def value(self, space: Space[Any], data: Any, path: str) -> Any:
        decoder = _DECODERS.get(type(space)) or handler_for(_DECODERS, space, path)
        return decoder(self, space, data, path)

    def rows(self, feature: Space[Any], data: Any, path: str) -> Any:
        """A stacked value of ``feature`` (its rows along the first axis)."""
        if isinstance(feature, _ARRAY_SPACES):
            arr = self.array(data, feature.dtype, None, path)
            if arr.shape[1:] != (feature.shape or ()) or arr.ndim == 0:
                raise SpaceCodecError(f"{path}: rows of shape {arr.shape[1:]}, not {feature.shape}")
            return arr
        items = _list(data, path)
        decoded = [self.value(feature, item, f"{path}[{i}]") for i, item in enumerate(items)]
        out: Any = create_empty_array(feature, len(decoded))
        return concatenate(feature, decoded, out) if decoded else out


def _list(data: Any, path: str) -> list[Any]:
    if not isinstance(data, list):
        raise SpaceCodecError(f"{path}: expected a list, got {type(data).__name__}")
    return data


def _dec_array(r: _Reader, space: Any, data: Any, path: str) -> Any:
    return r.array(data, space.dtype, space.shape, path)


def _dec_discrete(r: _Reader, space: Discrete, data: Any, path: str) -> Any:
    return _discrete_value_from_json(space, data, path)


def _dec_text(r: _Reader, space: Text, data: Any, path: str) -> Any:
    return _enc_text(None, space, data, path)  # type: ignore[arg-type]


def _dec_tuple(r: _Reader, space: Tuple, data: Any, path: str) -> Any:
    items = _list(data, path)
    if len(items) != len(space.spaces):
        raise SpaceCodecError(f"{path}: expected {len(space.spaces)} values, got {len(items)}")
    return tuple(
        r.value(sub, part, f"{path}[{i}]")
        for i, (sub, part) in enumerate(zip(space.spaces, items, strict=True))
    )


def _dec_dict(r: _Reader, space: Dict, data: Any, path: str) -> Any:
    if not isinstance(data, dict) or data.keys() != space.spaces.keys():
        raise SpaceCodecError(f"{path}: expected an object with keys {list(space.spaces)}")
    return {key: r.value(sub, data[key], f"{path}[{key!r}]") for key, sub in space.spaces.items()}


def _dec_sequence(r: _Reader, space: Sequence, data: Any, path: str) -> Any:
    if space.stack:
        return r.rows(space.feature_space, data, path)
    items = _list(data, path)
    return tuple(r.value(space.feature_space, item, f"{path}[{i}]") for i, item in enumerate(items))


def _dec_graph(r: _Reader, space: Graph, data: Any, path: str) -> Any:
    if not isinstance(data, dict) or set(data) != {"nodes", "edges", "edge_links"}:
        raise SpaceCodecError(f"{path}: expected an object with nodes, edges, edge_links")
    nodes = r.rows(space.node_space, data["nodes"], f"{path}.nodes")
    edges, links = data["edges"], data["edge_links"]
    if edges is not None:
        if space.edge_space is None:
            raise SpaceCodecError(f"{path}.edges: the space has no edge_space")
        edges = r.rows(space.edge_space, edges, f"{path}.edges")
    if links is not None:
        links = r.array(links, _EDGE_LINK_DTYPE, None, f"{path}.edge_links")
        if links.ndim != 2 or links.shape[1] != 2:
            raise SpaceCodecError(f"{path}.edge_links: expected shape (n, 2), got {links.shape}")
    return GraphInstance(nodes, edges, links)


def _dec_one_of(r: _Reader, space: OneOf, data: Any, path: str) -> Any:
    items = _list(data, path)
    if len(items) != 2 or type(items[0]) is not int:
        raise SpaceCodecError(f"{path}: expected [index, value]")
    index = _one_of_index(space, items[0], f"{path}[0]")
    return np.int64(index), r.value(space.spaces[index], items[1], f"{path}[1]")


_DECODERS: dict[type, Callable[[_Reader, Any, Any, str], Any]] = {
    Box: _dec_array,
    Discrete: _dec_discrete,
    MultiDiscrete: _dec_array,
    MultiBinary: _dec_array,
    Text: _dec_text,
    Tuple: _dec_tuple,
    Dict: _dec_dict,
    Sequence: _dec_sequence,
    Graph: _dec_graph,
    OneOf: _dec_one_of,
}


# Public ---------------------------------------------------------------------------------------

_TREE_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def value_to_tree(space: Space[Any], value: Any) -> tuple[Any, list[Buffer]]:
    """A value of ``space`` as its JSON tree and the raw buffers its array references name.

    The parts of a segment before framing (see the module); the buffers are
    views of the value's arrays where they are contiguous, not copies.

    Raises:
        SpaceCodecError: The value does not have the structure of ``space``.
    """
    writer = _Writer()
    try:
        tree = writer.value(space, value, "$")
    except SpaceCodecError:
        raise
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: cannot encode value for {space!r:.80}: {exc!r}") from exc
    return tree, writer.buffers


def value_from_tree(space: Space[Any], tree: Any, buffers: collections.abc.Sequence[Buffer]) -> Any:
    """Decode a tree and its buffers (`value_to_tree`) into a value of ``space``.

    Every buffer must back exactly one array of the value. Arrays are
    ``np.frombuffer`` views of the buffers, no copy: read-only where a buffer
    is, writable where it is writable (a view of a ``bytearray``).

    Raises:
        SpaceCodecError: The tree or a buffer does not fit ``space``.
    """
    try:
        reader = _Reader(buffers)
        value = reader.value(space, tree, "$")
        if reader.unnamed:
            raise SpaceCodecError(f"$: buffer {reader.named.index(0)} is not part of the value")
        return value
    except SpaceCodecError:
        raise
    except WRAPPED_ERRORS as exc:
        raise SpaceCodecError(f"$: invalid value for {space!r:.80}: {exc!r}") from exc


def value_to_segment(space: Space[Any], value: Any) -> bytes:
    """Encode a value of ``space`` as one binary segment (see the module).

    Raises:
        SpaceCodecError: The value does not have the structure of ``space``.
    """
    tree, buffers = value_to_tree(space, value)
    return frame(_TREE_ENCODER.encode(tree).encode(), buffers)


def value_from_segment(space: Space[Any], segment: Buffer) -> Any:
    """Decode a segment into a value of ``space``, as `value_from_json` would return it.

    Arrays are views of ``segment``, no copy: read-only when ``segment`` is
    (``bytes``), writable when it is (a ``bytearray``).

    Raises:
        SpaceCodecError: The segment is malformed or does not fit ``space``.
    """
    view = segment if isinstance(segment, memoryview) else memoryview(segment)
    tree, buffers = unframe(view, "segment")
    return value_from_tree(space, tree, buffers)
