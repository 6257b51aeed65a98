"""The binary segment codec (gym_sessions.spaces.binary): bit-exact like JSON, and strict."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
from gymnasium.spaces import Box, Dict, Discrete, Graph, GraphInstance, Sequence, Space, Tuple
from gymnasium.vector.utils import create_empty_array
from hypothesis import given, settings
from hypothesis import strategies as st

from gym_sessions.spaces import SpaceCodecError, value_from_json, value_to_json
from gym_sessions.spaces.binary import frame, unframe, value_from_segment, value_to_segment
from tests.test_spaces import (
    array_values,
    assert_same_value,
    boxes,
    gymnasium_contains_may_raise,
    nested_spaces,
    over_the_wire,
)


def binary_round_trip(space: Space[Any], value: Any) -> Any:
    return value_from_segment(space, bytes(value_to_segment(space, value)))


def check_both(space: Space[Any], value: Any) -> None:
    """Both encodings give back the value, and the same value as each other."""
    by_binary = binary_round_trip(space, value)
    by_json = value_from_json(space, over_the_wire(value_to_json(space, value)))
    assert_same_value(value, by_binary)
    assert_same_value(by_json, by_binary)
    assert value_to_json(space, by_binary) == value_to_json(space, value)


@settings(max_examples=60, deadline=None)
@given(space=boxes(), data=st.data())
def test_random_boxes_round_trip_in_both_encodings(space: Box, data: st.DataObject) -> None:
    check_both(space, data.draw(array_values(space.dtype, space.shape)))


@pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array")
@settings(max_examples=80, deadline=None)
@given(space=nested_spaces, seed=st.integers(0, 2**31))
def test_random_nested_spaces_round_trip_in_both_encodings(space: Space[Any], seed: int) -> None:
    space.seed(seed)
    for _ in range(3):
        value = space.sample()
        check_both(space, value)
        if not gymnasium_contains_may_raise(space):
            assert space.contains(binary_round_trip(space, value))
    if isinstance(space, Sequence) and space.stack:
        check_both(space, create_empty_array(space.feature_space, 0))


def test_arrays_are_read_only_views_of_the_received_bytes() -> None:
    space = Box(0, 255, shape=(210, 160, 3), dtype=np.uint8)
    frame_value = space.sample()
    received = bytearray(value_to_segment(space, frame_value))
    decoded = value_from_segment(space, memoryview(received).toreadonly())
    assert not decoded.flags.writeable
    assert decoded.flags.aligned
    assert np.shares_memory(decoded, np.frombuffer(received, np.uint8))
    assert_same_value(frame_value, decoded)


def test_nan_payload_and_negative_zero_are_kept_bit_for_bit() -> None:
    space = Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
    value = np.array([-0.0, np.nan, np.inf], dtype=np.float32)
    value.view(np.uint32)[1] = 0xFFC00123  # a NaN with a sign and a payload
    decoded = binary_round_trip(space, value)
    assert decoded.view(np.uint32).tolist() == value.view(np.uint32).tolist()


def test_values_are_cast_as_json_would_and_refused_where_json_refuses() -> None:
    space = Box(0, 10, shape=(2,), dtype=np.int8)
    assert binary_round_trip(space, np.array([1, 2], dtype=np.int64)).dtype == np.int8
    with pytest.raises(SpaceCodecError, match="out of range"):
        value_to_segment(space, np.array([1, 300]))
    with pytest.raises(SpaceCodecError, match="cannot send"):
        value_to_segment(space, np.array([1.5, 2.0]))
    with pytest.raises(SpaceCodecError, match="numeric array"):
        value_to_segment(space, np.array([object(), 1], dtype=object))


def segment(tree: Any, *buffers: bytes) -> bytes:
    return frame(json.dumps(tree).encode(), list(buffers))


BOX = Box(0.0, 1.0, shape=(2,), dtype=np.float32)
GOOD = np.zeros(2, np.float32).tobytes()
REF = {"buffer": 0, "dtype": "<f4", "shape": [2]}

MALFORMED: dict[str, tuple[Space[Any], bytes]] = {
    "empty": (BOX, b""),
    "truncated-table": (BOX, struct.pack("<II", 2, 5)),
    "head-past-end": (BOX, struct.pack("<II", 100, 0) + b"{}"),
    "blob-past-end": (BOX, struct.pack("<IIQ", 2, 1, 99) + b"{}"),
    "trailing-bytes": (BOX, segment(REF, GOOD) + b"\0"),
    "too-many-blobs": (BOX, struct.pack("<II", 2, 10**6) + b"{}"),
    "head-not-json": (BOX, frame(b"{nope", [GOOD])),
    "head-nan": (BOX, frame(b"NaN", [])),
    "not-a-ref": (BOX, segment([0.0, 1.0])),
    "ref-extra-key": (BOX, segment({**REF, "x": 1}, GOOD)),
    "no-such-buffer": (BOX, segment({**REF, "buffer": 1}, GOOD)),
    "buffer-index-bool": (BOX, segment({**REF, "buffer": True}, GOOD)),
    "wrong-dtype": (BOX, segment({**REF, "dtype": "<f8"}, np.zeros(2).tobytes())),
    "object-dtype": (BOX, segment({**REF, "dtype": "|O"}, GOOD)),
    "byte-order": (BOX, segment({**REF, "dtype": ">f4"}, GOOD)),
    "wrong-shape": (BOX, segment({**REF, "shape": [1, 2]}, GOOD)),
    "negative-shape": (BOX, segment({**REF, "shape": [-2]}, GOOD)),
    "float-shape": (BOX, segment({**REF, "shape": [2.0]}, GOOD)),
    "short-buffer": (BOX, segment(REF, GOOD[:4])),
    "long-buffer": (BOX, segment(REF, GOOD + GOOD)),
    "stacked-row-shape": (
        Sequence(BOX, stack=True),
        segment({"buffer": 0, "dtype": "<f4", "shape": [2, 1]}, GOOD),
    ),
    "stacked-huge-claim": (
        Sequence(BOX, stack=True),
        segment({"buffer": 0, "dtype": "<f4", "shape": [10**15, 2]}, GOOD),
    ),
    "buffer-named-twice": (Tuple((BOX, BOX)), segment([REF, REF], GOOD)),
    "buffer-of-no-array": (BOX, segment(REF, GOOD, GOOD)),
    "head-not-utf8": (BOX, frame(b'"\xff"', [])),
    "bool-byte-2": (
        Box(0, 1, (2,), np.bool_),
        segment({"buffer": 0, "dtype": "|b1", "shape": [2]}, b"\x01\x02"),
    ),
    "dict-keys": (Dict(a=BOX), segment({"b": REF}, GOOD)),
    "tuple-length": (Tuple((BOX, BOX)), segment([REF], GOOD)),
    "discrete-float": (Discrete(3), segment(1.0)),
    "graph-links-shape": (
        Graph(BOX, None),
        segment(
            {
                "nodes": REF,
                "edges": None,
                "edge_links": {"buffer": 1, "dtype": "<i4", "shape": [3]},
            },
            GOOD,
            np.zeros(3, np.int32).tobytes(),
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_segments_are_refused(name: str) -> None:
    space, data = MALFORMED[name]
    with pytest.raises(SpaceCodecError):
        value_from_segment(space, data)


def test_graph_edge_links_are_int32_as_json_gives_them() -> None:
    space = Graph(BOX, Discrete(2))
    value = GraphInstance(
        np.zeros((2, 2), np.float32), np.array([0, 1]), np.array([[0, 1], [1, 0]], dtype=np.int64)
    )
    decoded = binary_round_trip(space, value)
    assert decoded.edge_links.dtype == np.int32
    assert_same_value(value_from_json(space, value_to_json(space, value)), decoded)


def test_unframe_gives_aligned_blobs() -> None:
    blobs = [b"x", b"yyyyyyyyy", b"", b"zz"]
    head, got = unframe(memoryview(frame(b'{"a":1}', blobs)), "test")
    assert head == {"a": 1}
    assert [bytes(blob) for blob in got] == blobs
