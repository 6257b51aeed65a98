"""Numeric arrays, dtypes and Box bounds as JSON, exactly.

JSON has no infinities or NaN, so a non-finite float, wherever a float can
appear (bounds, array elements), is written as one of the strings ``"inf"``,
``"-inf"`` or ``"nan"`` (`NONFINITE`). Every other float is written as a JSON
number; float16 and float32 values are exactly representable as float64 and
Python writes floats in their shortest round-tripping form, so every value
comes back bit-exact (including ``-0.0``; the sign and payload of a NaN are not
kept). Dtypes are numpy names (``"float32"``, ``"uint8"``, ``"bool"``); a dtype
with a non-native byte order uses numpy's ``dtype.str`` (e.g. ``">f4"``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gym_sessions.spaces._codec import SpaceCodecError

__all__ = [
    "NONFINITE",
    "bound_from_json",
    "bound_to_json",
    "decode_array",
    "dtype_from_json",
    "dtype_to_json",
    "encode_array",
]

#: The strings that stand for non-finite floats.
NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def dtype_to_json(dtype: np.dtype[Any]) -> str:
    return dtype.name if dtype.isnative else dtype.str


def dtype_from_json(data: Any, kinds: str, path: str) -> np.dtype[Any]:
    if not isinstance(data, str):
        raise SpaceCodecError(f"{path}: dtype must be a string, got {type(data).__name__}")
    try:
        dtype = np.dtype(data)
    except (TypeError, ValueError) as exc:
        raise SpaceCodecError(f"{path}: unknown dtype {data!r}") from exc
    if dtype.kind not in kinds or (dtype.kind == "f" and dtype.itemsize > 8):
        raise SpaceCodecError(f"{path}: dtype {data!r} is not allowed here")
    return dtype


def encode_array(value: Any, path: str) -> Any:
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
    if kind is str and data in NONFINITE:
        return NONFINITE[data]
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


def decode_array(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], path: str) -> Any:
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


def bound_to_json(arr: np.ndarray, path: str) -> Any:
    """Encode a bound array, as one scalar when every element is identical."""
    if arr.size:
        first = arr.reshape(-1)[0]
        same = arr == first
        if arr.dtype.kind == "f":
            same &= np.signbit(arr) == np.signbit(first)
        if same.all():
            return encode_array(first, path)
    return encode_array(arr, path)


def bound_from_json(data: Any, dtype: np.dtype[Any], shape: tuple[int, ...], path: str) -> Any:
    if isinstance(data, list):
        return decode_array(data, dtype, shape, path)
    return np.full(shape, decode_array(data, dtype, (), path), dtype=dtype)
