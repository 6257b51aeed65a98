"""Tests for gym_sessions.spaces: the Gymnasium space <-> JSON codec."""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any

import numpy as np
import pytest
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
from gymnasium.vector.utils import create_empty_array
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gym_sessions.spaces import (
    SpaceCodecError,
    space_from_json,
    space_to_json,
    value_from_json,
    value_to_json,
)
from gym_sessions.spaces.values import space_contains

FLOAT_DTYPES = [np.float16, np.float32, np.float64]
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
ALL_BOX_DTYPES = [*FLOAT_DTYPES, *INT_DTYPES, np.bool_]


# ----------------------------------------------------------------------------- helpers


def over_the_wire(obj: Any) -> Any:
    """Serialise strictly (no NaN/inf literals) and parse back, like a real peer."""
    return json.loads(json.dumps(obj, allow_nan=False))


def assert_plain_json(obj: Any) -> None:
    """Only the exact built-in JSON types may appear (no numpy scalars)."""
    if isinstance(obj, dict):
        assert all(type(key) is str for key in obj)
        for item in obj.values():
            assert_plain_json(item)
    elif isinstance(obj, list):
        for item in obj:
            assert_plain_json(item)
    else:
        assert type(obj) in (str, int, float, bool, type(None)), type(obj)


def space_round_trip(space: Space[Any]) -> Space[Any]:
    data = space_to_json(space)
    assert_plain_json(data)
    assert isinstance(data["type"], str)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decoding must not trip gymnasium's warnings
        return space_from_json(over_the_wire(data))


def value_round_trip(space: Space[Any], value: Any) -> Any:
    data = value_to_json(space, value)
    assert_plain_json(data)
    return value_from_json(space, over_the_wire(data))


def assert_same_array(a: Any, b: Any) -> None:
    assert isinstance(a, np.ndarray), type(a)
    assert isinstance(b, np.ndarray), type(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), (a, b)
    if a.dtype.kind == "f":  # -0.0 must stay -0.0 (the sign of NaN is not kept)
        not_nan = ~np.isnan(a)
        assert np.array_equal(np.signbit(a)[not_nan], np.signbit(b)[not_nan]), (a, b)


def assert_same_space(a: Space[Any], b: Space[Any]) -> None:
    assert type(a) is type(b), (a, b)
    assert a == b, (a, b)
    if isinstance(a, Box):
        assert a.dtype == b.dtype
        assert a.shape == b.shape
        assert_same_array(a.low, b.low)
        assert_same_array(a.high, b.high)
        assert_same_array(np.asarray(a.bounded_below), np.asarray(b.bounded_below))
        assert_same_array(np.asarray(a.bounded_above), np.asarray(b.bounded_above))
    elif isinstance(a, Discrete):
        assert a.dtype == b.dtype
        assert type(a.n) is type(b.n)
        assert a.n == b.n
        assert type(a.start) is type(b.start)
        assert a.start == b.start
    elif isinstance(a, MultiDiscrete):
        assert_same_array(a.nvec, b.nvec)
        assert_same_array(a.start, b.start)
    elif isinstance(a, MultiBinary):
        assert a.n == b.n
        assert type(a.n) is type(b.n)
        assert a.shape == b.shape
    elif isinstance(a, Text):
        assert (a.min_length, a.max_length) == (b.min_length, b.max_length)
        assert a.character_list == b.character_list
    elif isinstance(a, (Tuple, OneOf)):
        assert len(a.spaces) == len(b.spaces)
        for sub_a, sub_b in zip(a.spaces, b.spaces, strict=True):
            assert_same_space(sub_a, sub_b)
    elif isinstance(a, Dict):
        assert list(a.spaces) == list(b.spaces)
        for key in a.spaces:
            assert_same_space(a.spaces[key], b.spaces[key])
    elif isinstance(a, Sequence):
        assert a.stack is b.stack
        assert_same_space(a.feature_space, b.feature_space)
    elif isinstance(a, Graph):
        assert_same_space(a.node_space, b.node_space)
        if a.edge_space is None:
            assert b.edge_space is None
        else:
            assert_same_space(a.edge_space, b.edge_space)


def assert_same_value(a: Any, b: Any) -> None:
    """Exact equality: same types, dtypes, shapes, NaN positions and zero signs."""
    if isinstance(a, np.ndarray):
        assert_same_array(a, b)
    elif isinstance(a, np.generic) and isinstance(b, np.ndarray):
        # Box.sample returns a numpy scalar (not a 0-d array) for integer Boxes of
        # shape (); the codec returns the documented 0-d array of the same dtype.
        assert b.shape == ()
        assert_same_array(np.asarray(a), b)
    elif isinstance(a, np.generic):
        assert type(a) is type(b), (type(a), type(b))
        assert_same_array(np.asarray(a), np.asarray(b))
    elif isinstance(a, GraphInstance):
        assert isinstance(b, GraphInstance)
        for part_a, part_b in zip(a, b, strict=True):
            if part_a is None:
                assert part_b is None
            else:
                assert_same_value(part_a, part_b)
    elif isinstance(a, tuple):
        assert type(b) is tuple, (a, b)
        assert len(a) == len(b), (a, b)
        for part_a, part_b in zip(a, b, strict=True):
            assert_same_value(part_a, part_b)
    elif isinstance(a, dict):
        assert type(b) is dict, (a, b)
        assert list(a) == list(b), (a, b)
        for key in a:
            assert_same_value(a[key], b[key])
    else:
        assert type(a) is type(b), (a, b)
        assert a == b, (a, b)


def stacks_without_length(space: Space[Any]) -> bool:
    """Whether the stacked form of ``space`` is the same for any number of elements.

    gymnasium stacks a Tuple/Dict part by part, so one made only of empty
    Tuples/Dicts stacks to ``()``/``{}`` whatever the length.
    """
    if isinstance(space, Tuple):
        return all(stacks_without_length(sub) for sub in space.spaces)
    if isinstance(space, Dict):
        return all(stacks_without_length(sub) for sub in space.spaces.values())
    return False


def mixes_stacked_lengths(feature: Space[Any]) -> bool:
    """Whether a stacked Tuple/Dict has parts with and without a stacked length."""
    if isinstance(feature, (Tuple, Dict)):
        subs = list(feature.spaces.values() if isinstance(feature, Dict) else feature.spaces)
        flags = [stacks_without_length(sub) for sub in subs]
        return (any(flags) and not all(flags)) or any(mixes_stacked_lengths(s) for s in subs)
    return False


def gymnasium_contains_may_raise(space: Space[Any]) -> bool:
    """Whether gymnasium's own ``contains`` can raise on (any) sample of ``space``.

    ``Sequence(stack=True).contains`` zips the parts of a stacked Tuple/Dict with
    ``strict=True``; a part without a stacked length (e.g. ``Tuple(())`` beside a
    Box) has zero rows, so the zip raises ValueError on gymnasium's own samples.
    The codec still round-trips those values exactly; only membership is unchecked.
    """
    if isinstance(space, Sequence):
        return (space.stack and mixes_stacked_lengths(space.feature_space)) or (
            gymnasium_contains_may_raise(space.feature_space)
        )
    if isinstance(space, (Tuple, OneOf)):
        return any(gymnasium_contains_may_raise(sub) for sub in space.spaces)
    if isinstance(space, Dict):
        return any(gymnasium_contains_may_raise(sub) for sub in space.spaces.values())
    return False


def check_samples(space: Space[Any], seed: int, n: int = 4) -> None:
    decoded_space = space_round_trip(space)
    assert_same_space(space, decoded_space)
    check_contains = not gymnasium_contains_may_raise(space)
    space.seed(seed)
    for _ in range(n):
        value = space.sample()
        decoded = value_round_trip(decoded_space, value)
        assert_same_value(value, decoded)
        if check_contains:
            assert space.contains(decoded), (space, value, decoded)
            assert decoded_space.contains(decoded)


# ----------------------------------------------------------------------- fixed spaces


def f16(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float16)


SPACES: dict[str, Space[Any]] = {
    "box-f32": Box(-1.0, 2.5, shape=(3, 2), dtype=np.float32),
    "box-f32-unbounded": Box(-np.inf, np.inf, shape=(4,), dtype=np.float32),
    "box-f64-half-bounded": Box(
        np.array([-np.inf, 0.0, -0.0, -1e300]),
        np.array([0.0, np.inf, 5e-324, 1e300]),
        dtype=np.float64,
    ),
    "box-f16-mixed": Box(f16([-np.inf, -0.0, 0.5]), f16([-0.0, 65504.0, np.inf]), dtype=np.float16),
    "box-f32-scalar-shape": Box(-0.0, 0.0, shape=(), dtype=np.float32),
    "box-int8-inf": Box(-np.inf, np.inf, shape=(2, 2), dtype=np.int8),
    "box-int64-inf": Box(-np.inf, np.inf, shape=(3,), dtype=np.int64),
    "box-int16-partly-unbounded": Box(
        np.array([-np.inf, -3.0]), np.array([7.0, 9.0]), dtype=np.int16
    ),
    "box-uint8-image": Box(0, 255, shape=(4, 5, 3), dtype=np.uint8),
    "box-uint64-full": Box(0, 2**64 - 1, shape=(2,), dtype=np.uint64),
    "box-int64-extremes": Box(
        np.array([-(2**63), 0], dtype=np.int64),
        np.array([2**63 - 2, 2**62], dtype=np.int64),
        dtype=np.int64,
    ),
    "box-bool": Box(np.array([False, True, False]), np.array([True, True, False]), dtype=np.bool_),
    "box-empty": Box(0.0, 1.0, shape=(0, 3), dtype=np.float32),
    "discrete": Discrete(5),
    "discrete-start": Discrete(7, start=-3),
    "discrete-int8": Discrete(4, start=100, dtype=np.int8),
    "discrete-uint64-big": Discrete(3, start=2**64 - 3, dtype=np.uint64),
    "multidiscrete": MultiDiscrete([3, 4, 5]),
    "multidiscrete-start-2d": MultiDiscrete([[2, 3], [4, 5]], start=[[-1, 10], [0, -7]]),
    "multidiscrete-int8": MultiDiscrete([5, 6], dtype=np.int8, start=[-128, 121]),
    "multibinary": MultiBinary(6),
    "multibinary-2d": MultiBinary([2, 3]),
    "text": Text(8),
    "text-charset": Text(6, min_length=0, charset='zyx €\n"\\é'),
    "tuple": Tuple([Discrete(3), Box(-1, 1, shape=(2,)), Text(4)]),
    "tuple-empty": Tuple([]),
    "dict-empty": Dict({}),
    "dict-unsorted": Dict(
        [("zeta", Discrete(2)), ("alpha", Box(0, 1, shape=(1,))), ("mid", MultiBinary(2))]
    ),
    "dict-nested": Dict(
        {
            "pos": Box(-np.inf, np.inf, shape=(2,), dtype=np.float64),
            "inner": Dict([("b", Tuple([Discrete(2, start=1), Text(3)])), ("a", MultiBinary(2))]),
        },
        sort_keys=False,
    ),
    "sequence": Sequence(Box(-1, 1, shape=(2,))),
    "sequence-stack-box": Sequence(Box(-1, 1, shape=(2,), dtype=np.float16), stack=True),
    "sequence-stack-discrete": Sequence(Discrete(4, start=2), stack=True),
    "sequence-stack-dict": Sequence(Dict([("t", Text(3)), ("d", Discrete(3))]), stack=True),
    "sequence-stack-tuple": Sequence(Tuple([MultiBinary(2), Text(2)]), stack=True),
    "sequence-of-sequence": Sequence(Sequence(Discrete(3))),
    "sequence-stack-empty-tuple": Sequence(Tuple([]), stack=True),
    "sequence-stack-empty-tuple-part": Sequence(
        Dict([("a", Tuple([])), ("b", Box(-1, 1, shape=(), dtype=np.float16))]), stack=True
    ),
    "sequence-stack-nested-empty-part": Sequence(
        Tuple([Discrete(3), Tuple([Tuple([]), Dict({})]), Text(2)]), stack=True
    ),
    "graph": Graph(node_space=Box(-1, 1, shape=(3,)), edge_space=Discrete(4)),
    "graph-discrete-nodes-no-edges": Graph(node_space=Discrete(5, start=1), edge_space=None),
    "graph-box-edges": Graph(node_space=Discrete(3), edge_space=Box(0, 1, shape=(2,))),
    "oneof": OneOf([Discrete(2), Box(-1, 1, shape=(2,)), Text(3)]),
    "oneof-nested": OneOf([Tuple([Discrete(2), MultiBinary(1)]), Dict(a=Discrete(3))]),
    "everything": Dict(
        [
            ("seq", Sequence(OneOf([Discrete(2), Graph(Discrete(2), Discrete(2))]))),
            ("tup", Tuple([Sequence(Text(2), stack=True), MultiDiscrete([2, 2], start=[5, 6])])),
            ("box", Box(-np.inf, 0, shape=(2,), dtype=np.float64)),
        ]
    ),
}

BOX_DTYPE_SPACES = {
    f"box-{np.dtype(dtype).name}": Box(0, 1, shape=(2, 3), dtype=dtype) for dtype in ALL_BOX_DTYPES
}


@pytest.mark.parametrize(
    "space", [*SPACES.values(), *BOX_DTYPE_SPACES.values()], ids=[*SPACES, *BOX_DTYPE_SPACES]
)
def test_description_round_trip(space: Space[Any]) -> None:
    assert_same_space(space, space_round_trip(space))


@pytest.mark.parametrize(
    "space", [*SPACES.values(), *BOX_DTYPE_SPACES.values()], ids=[*SPACES, *BOX_DTYPE_SPACES]
)
@pytest.mark.parametrize("seed", [0, 123])
def test_sample_round_trip(space: Space[Any], seed: int) -> None:
    check_samples(space, seed)


def test_description_format_is_readable() -> None:
    data = space_to_json(Box(-np.inf, 1.0, shape=(2,), dtype=np.float32))
    assert data == {"type": "Box", "dtype": "float32", "shape": [2], "low": "-inf", "high": 1.0}
    data = space_to_json(Box(np.array([0.0, -0.0]), np.array([1.0, 2.0]), dtype=np.float64))
    assert data["low"] == [0.0, -0.0]
    assert [np.signbit(x) for x in data["low"]] == [False, True]
    assert space_to_json(Discrete(3, start=-1)) == {
        "type": "Discrete",
        "n": 3,
        "start": -1,
        "dtype": "int64",
    }
    dict_data = space_to_json(SPACES["dict-unsorted"])
    assert [key for key, _ in dict_data["spaces"]] == ["zeta", "alpha", "mid"]


def test_description_accepts_scalar_and_full_bounds() -> None:
    base = {"type": "Box", "dtype": "float32", "shape": [2, 2]}
    scalar = space_from_json({**base, "low": "-inf", "high": -0.0})
    full = space_from_json(
        {**base, "low": [["-inf", "-inf"], ["-inf", "-inf"]], "high": [[-0.0, -0.0], [-0.0, -0.0]]}
    )
    assert_same_space(scalar, full)
    assert np.all(np.signbit(scalar.high))
    assert not scalar.bounded_below.any()
    assert scalar.bounded_above.all()


def test_integer_box_keeps_unboundedness() -> None:
    space = SPACES["box-int16-partly-unbounded"]
    decoded = space_round_trip(space)
    assert decoded.low.tolist() == [np.iinfo(np.int16).min, -3]
    assert decoded.bounded_below.tolist() == [False, True]
    assert decoded.bounded_above.tolist() == [True, True]
    assert decoded.is_bounded("below") is False
    assert decoded.is_bounded("above") is True


def test_non_native_byte_order_dtype() -> None:
    space = Box(0.0, 1.0, shape=(2,), dtype=np.dtype(">f4"))
    data = space_to_json(space)
    assert data["dtype"] == ">f4"
    decoded = space_round_trip(space)
    assert decoded.dtype == np.dtype(">f4")
    value = np.array([0.25, -0.0], dtype=">f4")
    assert_same_value(value, value_round_trip(decoded, value))


# ----------------------------------------------------------------------- edge values


@pytest.mark.parametrize("name", [name for name in SPACES if name.startswith("box")])
def test_box_bound_values_round_trip(name: str) -> None:
    space = SPACES[name]
    for value in (space.low, space.high):
        decoded = value_round_trip(space, value.copy())
        assert_same_value(value, decoded)
        assert space.contains(decoded)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_non_finite_values_are_strings(dtype: type) -> None:
    space = Box(-np.inf, np.inf, shape=(2, 3), dtype=dtype)
    value = np.array([[np.inf, -np.inf, np.nan], [-0.0, 0.0, 1.5]], dtype=dtype)
    data = value_to_json(space, value)
    assert data[0] == ["inf", "-inf", "nan"]
    assert data[1] == [-0.0, 0.0, 1.5]
    decoded = value_from_json(space, over_the_wire(data))
    assert_same_value(value, decoded)
    scalar_space = Box(-np.inf, np.inf, shape=(), dtype=dtype)
    assert value_to_json(scalar_space, np.array(-np.inf, dtype=dtype)) == "-inf"
    assert_same_value(np.array(np.nan, dtype=dtype), value_from_json(scalar_space, "nan"))


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, *INT_DTYPES])
def test_dtype_extremes_are_exact(dtype: type) -> None:
    dt = np.dtype(dtype)
    info = np.finfo(dt) if dt.kind == "f" else np.iinfo(dt)
    extremes = [info.min, info.max, 0]
    if dt.kind == "f":
        extremes += [info.tiny, info.smallest_subnormal, info.eps, -info.smallest_subnormal]
    value = np.array(extremes, dtype=dt)
    space = Box(info.min, info.max, shape=value.shape, dtype=dt)
    decoded = value_round_trip(space, value)
    assert_same_value(value, decoded)
    assert space.contains(decoded)


def test_discrete_values_use_space_dtype() -> None:
    assert value_to_json(SPACES["discrete-start"], np.int64(-3)) == -3
    for space, value in (
        (SPACES["discrete"], np.int64(3)),
        (SPACES["discrete-int8"], np.int8(102)),
    ):
        decoded = value_from_json(space, int(value))
        assert type(decoded) is type(value)
        assert decoded == value
    big = SPACES["discrete-uint64-big"]
    assert_same_value(np.uint64(2**64 - 1), value_round_trip(big, np.uint64(2**64 - 1)))


def test_stacked_sequence_json_is_the_array_as_list() -> None:
    space = SPACES["sequence-stack-box"]
    value = np.array([[0.5, -0.0], [1.0, -1.0], [0.25, 0.125]], dtype=np.float16)
    assert value_to_json(space, value) == value.tolist()
    assert_same_value(value, value_round_trip(space, value))
    empty = np.zeros((0, 2), dtype=np.float16)
    assert value_to_json(space, empty) == []
    assert_same_value(empty, value_from_json(space, []))


def test_stacked_sequence_with_empty_tuple_part() -> None:
    # Tuple(()) stacks to () whatever the length: each row gets its only element.
    space = SPACES["sequence-stack-empty-tuple-part"]
    value = {"a": (), "b": np.array([0.5, -0.0, 1.0], dtype=np.float16)}
    data = value_to_json(space, value)
    assert data == [{"a": [], "b": 0.5}, {"a": [], "b": -0.0}, {"a": [], "b": 1.0}]
    assert_same_value(value, value_from_json(space, over_the_wire(data)))
    empty = {"a": (), "b": np.zeros(0, dtype=np.float16)}
    assert value_to_json(space, empty) == []
    assert_same_value(empty, value_from_json(space, []))
    nested = SPACES["sequence-stack-nested-empty-part"]
    value = (np.array([2, 0]), ((), {}), ("ab", ""))
    data = value_to_json(nested, value)
    assert data == [[2, [[], {}], "ab"], [0, [[], {}], ""]]
    assert_same_value(value, value_from_json(nested, over_the_wire(data)))
    with pytest.raises(SpaceCodecError, match="different lengths"):
        value_to_json(nested, (np.array([2, 0]), ((), {}), ("ab",)))
    # With no part recording a length, every value is () and is written as [].
    only_empty = SPACES["sequence-stack-empty-tuple"]
    assert value_to_json(only_empty, ()) == []
    assert value_from_json(only_empty, []) == ()
    assert value_from_json(only_empty, [[], []]) == ()


@pytest.mark.parametrize(
    "name",
    [
        "sequence-stack-dict",
        "sequence-stack-tuple",
        "sequence-stack-empty-tuple-part",
        "sequence-stack-nested-empty-part",
    ],
)
def test_empty_stacked_sequence_of_composite(name: str) -> None:
    # gymnasium's concatenate cannot stack zero elements; the empty value is the
    # empty buffer create_empty_array builds (arrays of length 0, empty tuples).
    space = SPACES[name]
    empty = create_empty_array(space.feature_space, 0)
    assert value_to_json(space, empty) == []
    decoded = value_from_json(space, [])
    assert_same_value(empty, decoded)
    if not gymnasium_contains_may_raise(space):
        assert space.contains(decoded)


def test_graph_value_shape() -> None:
    space = SPACES["graph"]
    value = GraphInstance(
        nodes=np.array([[0.5, -0.0, 1.0], [0.0, 0.0, -1.0]], dtype=np.float32),
        edges=np.array([3, 0], dtype=np.int64),
        edge_links=np.array([[0, 1], [1, 1]], dtype=np.int32),
    )
    data = value_to_json(space, value)
    assert data == {
        "nodes": [[0.5, -0.0, 1.0], [0.0, 0.0, -1.0]],
        "edges": [3, 0],
        "edge_links": [[0, 1], [1, 1]],
    }
    decoded = value_from_json(space, over_the_wire(data))
    assert_same_value(value, decoded)
    assert space.contains(decoded)
    no_edges = GraphInstance(value.nodes, None, None)
    assert value_to_json(space, no_edges)["edges"] is None
    assert_same_value(no_edges, value_round_trip(space, no_edges))


def test_oneof_and_dict_value_shapes() -> None:
    space = SPACES["oneof"]
    assert value_to_json(space, (np.int64(2), "ab")) == [2, "ab"]
    decoded = value_from_json(space, [1, [0.5, "-inf"]])
    assert type(decoded) is tuple
    assert type(decoded[0]) is np.int64
    assert decoded[0] == 1
    assert_same_array(decoded[1], np.array([0.5, -np.inf], dtype=np.float32))
    dict_space = SPACES["dict-unsorted"]
    value = {
        "mid": np.array([1, 0], dtype=np.int8),
        "zeta": np.int64(1),
        "alpha": np.zeros(1, np.float32),
    }
    assert list(value_to_json(dict_space, value)) == ["zeta", "alpha", "mid"]
    assert list(value_round_trip(dict_space, value)) == ["zeta", "alpha", "mid"]


# ----------------------------------------------------------------------- hypothesis


def box_from_arrays(low: Any, high: Any, dtype: np.dtype[Any]) -> Box:
    # numpy ufuncs turn 0-d arrays into scalars; Box wants arrays (or Python numbers)
    return Box(np.asarray(low, dtype=dtype), np.asarray(high, dtype=dtype), dtype=dtype)


@st.composite
def boxes(draw: st.DrawFn) -> Box:
    dtype = np.dtype(draw(st.sampled_from(ALL_BOX_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    if dtype.kind == "f":
        elements = st.floats(width=dtype.itemsize * 8, allow_nan=False)
        a = draw(hnp.arrays(dtype, shape, elements=elements))
        b = draw(hnp.arrays(dtype, shape, elements=elements))
        return box_from_arrays(np.minimum(a, b), np.maximum(a, b), dtype)
    if dtype.kind == "b":
        a = draw(hnp.arrays(dtype, shape))
        b = draw(hnp.arrays(dtype, shape))
        return box_from_arrays(a & b, a | b, dtype)
    info = np.iinfo(dtype)
    if dtype.kind == "i" and draw(st.booleans()):
        low = -np.inf if draw(st.booleans()) else int(info.min)
        high = np.inf if draw(st.booleans()) else int(info.max)
        return Box(low, high, shape=shape, dtype=dtype)
    elements = st.integers(int(info.min), int(info.max))
    a = draw(hnp.arrays(dtype, shape, elements=elements))
    b = draw(hnp.arrays(dtype, shape, elements=elements))
    return box_from_arrays(np.minimum(a, b), np.maximum(a, b), dtype)


def array_values(dtype: np.dtype[Any], shape: tuple[int, ...]) -> st.SearchStrategy[np.ndarray]:
    if dtype.kind == "f":
        # any float, including NaN, infinities, subnormals and -0.0
        return hnp.arrays(dtype, shape, elements=st.floats(width=dtype.itemsize * 8))
    return hnp.arrays(dtype, shape)


@settings(max_examples=60, deadline=None)
@given(space=boxes(), data=st.data())
def test_random_boxes_round_trip(space: Box, data: st.DataObject) -> None:
    assert_same_space(space, space_round_trip(space))
    value = data.draw(array_values(space.dtype, space.shape))
    assert_same_value(value, value_round_trip(space, value))


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(INT_DTYPES),
    data=st.data(),
)
def test_random_discrete_spaces_round_trip(dtype: type, data: st.DataObject) -> None:
    info = np.iinfo(dtype)
    shape = data.draw(hnp.array_shapes(min_dims=1, max_dims=2, max_side=3))
    size = int(np.prod(shape))
    nvec = data.draw(st.lists(st.integers(1, 20), min_size=size, max_size=size))
    start = data.draw(
        st.lists(st.integers(int(info.min), int(info.max) - 20), min_size=size, max_size=size)
    )
    multi = MultiDiscrete(
        np.array(nvec, dtype=dtype).reshape(shape),
        dtype=dtype,
        start=np.array(start, dtype=dtype).reshape(shape),
    )
    single = Discrete(nvec[0], start=start[0], dtype=dtype)
    seed = data.draw(st.integers(0, 2**31))
    check_samples(multi, seed)
    check_samples(single, seed)


def leaf_spaces() -> st.SearchStrategy[Space[Any]]:
    small_shapes = hnp.array_shapes(min_dims=0, max_dims=2, max_side=3)
    return st.one_of(
        st.builds(
            lambda shape, dtype: Box(-1.0, 1.0, shape=shape, dtype=dtype),
            small_shapes,
            st.sampled_from(FLOAT_DTYPES),
        ),
        st.builds(lambda shape: Box(-np.inf, np.inf, shape=shape), small_shapes),
        st.builds(
            lambda shape, dtype: Box(0, 5, shape=shape, dtype=dtype),
            small_shapes,
            st.sampled_from(INT_DTYPES),
        ),
        st.builds(lambda n, start: Discrete(n, start=start), st.integers(1, 5), st.integers(-5, 5)),
        st.builds(
            lambda nvec, start: MultiDiscrete(nvec, start=start[: len(nvec)]),
            st.lists(st.integers(1, 4), min_size=1, max_size=3),
            st.lists(st.integers(-3, 3), min_size=3, max_size=3),
        ),
        st.builds(MultiBinary, st.integers(1, 4)),
        st.builds(
            lambda charset, lengths: Text(max(lengths), min_length=min(lengths), charset=charset),
            # (no NUL: gymnasium's Text.sample drops it, numpy strips trailing NULs)
            st.text(st.characters(exclude_characters="\x00"), min_size=1, max_size=6),
            st.tuples(st.integers(0, 4), st.integers(0, 4)),
        ),
        st.builds(
            Graph,
            st.sampled_from([Box(-1, 1, shape=(2,)), Discrete(3, start=1)]),
            st.sampled_from([None, Discrete(2), Box(0, 1, shape=(1,), dtype=np.float64)]),
        ),
    )


def composite_spaces(children: st.SearchStrategy[Space[Any]]) -> st.SearchStrategy[Space[Any]]:
    keys = st.text(alphabet="abcxyz", min_size=1, max_size=3)
    return st.one_of(
        st.builds(Tuple, st.lists(children, max_size=3)),
        st.builds(
            lambda items: Dict(items),  # a list of pairs keeps the drawn (unsorted) order
            # (no empty Dict: gymnasium's Sequence(Dict(), stack=True).contains raises)
            st.lists(
                st.tuples(keys, children), min_size=1, max_size=3, unique_by=lambda item: item[0]
            ),
        ),
        st.builds(lambda sub, stack: Sequence(sub, stack=stack), children, st.booleans()),
        st.builds(OneOf, st.lists(children, min_size=1, max_size=3)),
    )


def sequence_depth(space: Space[Any]) -> int:
    """How many Sequences are nested; sample sizes grow geometrically with it."""
    if isinstance(space, Sequence):
        return 1 + sequence_depth(space.feature_space)
    if isinstance(space, (Tuple, OneOf)):
        return max((sequence_depth(sub) for sub in space.spaces), default=0)
    if isinstance(space, Dict):
        return max((sequence_depth(sub) for sub in space.spaces.values()), default=0)
    return 0


nested_spaces = st.recursive(leaf_spaces(), composite_spaces, max_leaves=5).filter(
    lambda space: sequence_depth(space) <= 2
)


@pytest.mark.filterwarnings("ignore:.*Casting input x to numpy array")
@settings(max_examples=60, deadline=None)
@given(space=nested_spaces, seed=st.integers(0, 2**31))
def test_random_nested_spaces_round_trip(space: Space[Any], seed: int) -> None:
    check_samples(space, seed, n=3)
    if isinstance(space, Sequence) and space.stack:  # gymnasium never samples length 0
        empty = create_empty_array(space.feature_space, 0)
        assert_same_value(empty, value_round_trip(space, empty))


# ----------------------------------------------------------------------- malformed input


def nested_tuples(depth: int) -> dict[str, Any]:
    data: dict[str, Any] = {"type": "Discrete", "n": 2, "start": 0, "dtype": "int64"}
    for _ in range(depth):
        data = {"type": "Tuple", "spaces": [data]}
    return data


BOX = {"type": "Box", "dtype": "float32", "shape": [2], "low": 0.0, "high": 1.0}
DISCRETE = {"type": "Discrete", "n": 3, "start": 0, "dtype": "int64"}
MALFORMED_DESCRIPTIONS: dict[str, Any] = {
    "not-an-object": ["Box"],
    "none": None,
    "no-type": {"n": 3},
    "unknown-type": {"type": "Hexagon"},
    "type-not-str": {"type": 3},
    "box-missing-key": {"type": "Box", "dtype": "float32", "shape": [2], "low": 0.0},
    "box-unknown-key": {**BOX, "colour": "red"},
    "box-complex-dtype": {**BOX, "dtype": "complex64"},
    "box-junk-dtype": {**BOX, "dtype": "not-a-dtype"},
    "box-object-dtype": {**BOX, "dtype": "O"},
    "box-dtype-not-str": {**BOX, "dtype": 4},
    "box-negative-shape": {**BOX, "shape": [-1]},
    "box-float-shape": {**BOX, "shape": [1.5]},
    "box-bool-shape": {**BOX, "shape": [True]},
    "box-shape-not-list": {**BOX, "shape": "2"},
    "box-huge-shape": {**BOX, "shape": [100_000, 100_000]},
    "box-numeric-string": {**BOX, "low": "0.5"},
    "box-bad-string-in-list": {**BOX, "low": ["-inf", "x"]},
    "box-wrong-length": {**BOX, "low": [0.0, 0.0, 0.0]},
    "box-too-deep": {**BOX, "low": [[0.0], [0.0]]},
    "box-low-above-high": {**BOX, "low": 2.0},
    "box-nan-bound": {**BOX, "high": "nan"},
    "box-null-bound": {**BOX, "low": None},
    "box-object-bound": {**BOX, "low": {"v": 1}},
    "box-uint-negative": {**BOX, "dtype": "uint8", "low": -1, "high": 3},
    "box-int-out-of-range": {**BOX, "dtype": "int8", "low": 0, "high": 300},
    "box-int-float-bound": {**BOX, "dtype": "int8", "low": 0.5, "high": 3},
    "box-bool-int-bound": {**BOX, "dtype": "bool", "low": 0, "high": 1},
    "box-bounded-wrong-shape": {**BOX, "bounded_below": [True, True, True]},
    "box-bounded-not-bool": {**BOX, "bounded_above": 1},
    "discrete-zero-n": {**DISCRETE, "n": 0},
    "discrete-str-n": {**DISCRETE, "n": "3"},
    "discrete-bool-n": {**DISCRETE, "n": True},
    "discrete-float-n": {**DISCRETE, "n": 3.0},
    "discrete-float-dtype": {**DISCRETE, "dtype": "float32"},
    "discrete-overflow": {**DISCRETE, "n": 300, "dtype": "int8"},
    "discrete-missing-start": {"type": "Discrete", "n": 3, "dtype": "int64"},
    "multidiscrete-zero": {
        "type": "MultiDiscrete",
        "dtype": "int64",
        "shape": [2],
        "nvec": [0, 2],
        "start": [0, 0],
    },
    "multidiscrete-shape-mismatch": {
        "type": "MultiDiscrete",
        "dtype": "int64",
        "shape": [3],
        "nvec": [2, 2],
        "start": [0, 0],
    },
    "multidiscrete-scalar-nvec": {
        "type": "MultiDiscrete",
        "dtype": "int64",
        "shape": [],
        "nvec": 2,
        "start": 0,
    },
    "multibinary-str": {"type": "MultiBinary", "n": "3"},
    "multibinary-zero": {"type": "MultiBinary", "n": [0, 2]},
    "multibinary-float": {"type": "MultiBinary", "n": [1.5]},
    "text-min-above-max": {"type": "Text", "min_length": 5, "max_length": 2, "charset": "ab"},
    "text-negative-min": {"type": "Text", "min_length": -1, "max_length": 2, "charset": "ab"},
    "text-charset-list": {"type": "Text", "min_length": 1, "max_length": 2, "charset": ["a"]},
    "tuple-spaces-not-list": {"type": "Tuple", "spaces": DISCRETE},
    "tuple-bad-child": {"type": "Tuple", "spaces": [DISCRETE, 7]},
    "tuple-bad-grandchild": {
        "type": "Tuple",
        "spaces": [{"type": "Tuple", "spaces": [{"type": "X"}]}],
    },
    "dict-object-form": {"type": "Dict", "spaces": {"a": DISCRETE}},
    "dict-short-pair": {"type": "Dict", "spaces": [["a"]]},
    "dict-int-key": {"type": "Dict", "spaces": [[1, DISCRETE]]},
    "dict-duplicate-key": {"type": "Dict", "spaces": [["a", DISCRETE], ["a", DISCRETE]]},
    "sequence-stack-not-bool": {"type": "Sequence", "feature_space": DISCRETE, "stack": "yes"},
    "sequence-missing-feature": {"type": "Sequence", "stack": False},
    "graph-missing-edge-space": {"type": "Graph", "node_space": BOX},
    "graph-bad-node-space": {"type": "Graph", "node_space": {}, "edge_space": None},
    "oneof-empty": {"type": "OneOf", "spaces": []},
    "too-deep": nested_tuples(500),
}


@pytest.mark.parametrize(
    "data", list(MALFORMED_DESCRIPTIONS.values()), ids=list(MALFORMED_DESCRIPTIONS)
)
def test_malformed_descriptions_raise(data: Any) -> None:
    with pytest.raises(SpaceCodecError):
        space_from_json(data)


def test_space_codec_error_is_value_error_with_path() -> None:
    assert issubclass(SpaceCodecError, ValueError)
    with pytest.raises(SpaceCodecError, match=r"\$\.spaces\[1\]"):
        space_from_json(MALFORMED_DESCRIPTIONS["tuple-bad-child"])


class CustomSpace(Space[int]):
    pass


@pytest.mark.parametrize(
    "space",
    [CustomSpace(), Dict({1: Discrete(2)}), Tuple([Discrete(2), CustomSpace()])],
    ids=["custom", "dict-int-key", "nested-custom"],
)
def test_unsupported_spaces_raise(space: Space[Any]) -> None:
    with pytest.raises(SpaceCodecError):
        space_to_json(space)


BOX3 = Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
INT8_BOX = Box(-5, 5, shape=(3,), dtype=np.int8)
MALFORMED_VALUES: dict[str, tuple[Space[Any], Any]] = {
    "box-short": (BOX3, [0.0, 0.0]),
    "box-too-deep": (BOX3, [[0.0, 0.0, 0.0]]),
    "box-scalar": (BOX3, "inf"),
    "box-bad-string": (BOX3, [0.0, "infinity", 0.0]),
    "box-numeric-string": (BOX3, ["0.5", 0.0, 0.0]),
    "box-null": (BOX3, [0.0, None, 0.0]),
    "box-ragged": (BOX3, [0.0, [1.0], 0.0]),
    "box-object": (BOX3, {"x": 1.0}),
    "box-bools": (BOX3, [True, False, True]),
    "box-huge-int": (BOX3, [10**400, 0, 0]),
    "box-f32-overflow": (BOX3, [1e39, 0.0, 0.0]),
    "box-f16-overflow": (Box(0, 1, shape=(1,), dtype=np.float16), [70000]),
    "int-box-floats": (INT8_BOX, [1.0, 2.0, 3.0]),
    "int-box-overflow": (INT8_BOX, [1, 2, 300]),
    "int-box-inf": (INT8_BOX, ["inf", 1, 2]),
    "bool-box-ints": (Box(0, 1, shape=(2,), dtype=np.bool_), [0, 1]),
    "multibinary-float": (MultiBinary(2), [0, 0.5]),
    "multidiscrete-shape": (MultiDiscrete([2, 2]), [[0, 1]]),
    "discrete-float": (Discrete(3), 1.0),
    "discrete-str": (Discrete(3), "1"),
    "discrete-bool": (Discrete(3), True),
    "discrete-list": (Discrete(3), [1]),
    "discrete-overflow": (Discrete(3, dtype=np.int8), 300),
    "text-int": (Text(3), 5),
    "text-null": (Text(3), None),
    "tuple-short": (SPACES["tuple"], [0, [0.0, 0.0]]),
    "tuple-object": (SPACES["tuple"], {"0": 0}),
    "dict-missing-key": (SPACES["dict-unsorted"], {"zeta": 0, "alpha": [0.0]}),
    "dict-extra-key": (Dict(a=Discrete(2)), {"a": 0, "b": 1}),
    "dict-list": (Dict(a=Discrete(2)), [0]),
    "sequence-not-list": (SPACES["sequence"], {"0": [0.0, 0.0]}),
    "sequence-bad-item": (SPACES["sequence"], [[0.0, 0.0], [0.0]]),
    "stacked-ragged": (SPACES["sequence-stack-box"], [[0.0, 0.0], [0.0]]),
    "stacked-scalar": (SPACES["sequence-stack-discrete"], 3),
    "graph-list": (SPACES["graph"], [[0.0, 0.0, 0.0]]),
    "graph-no-nodes": (SPACES["graph"], {"edges": None, "edge_links": None}),
    "graph-unknown-key": (SPACES["graph"], {"nodes": [[0.0, 0.0, 0.0]], "weights": []}),
    "graph-edges-without-space": (
        SPACES["graph-discrete-nodes-no-edges"],
        {"nodes": [1, 2], "edges": [0], "edge_links": [[0, 1]]},
    ),
    "graph-bad-links": (
        SPACES["graph"],
        {"nodes": [[0.0, 0.0, 0.0]], "edges": [1], "edge_links": [[0, 0, 0]]},
    ),
    "graph-float-links": (
        SPACES["graph"],
        {"nodes": [[0.0, 0.0, 0.0]], "edges": [1], "edge_links": [[0.0, 0.0]]},
    ),
    "oneof-index-range": (SPACES["oneof"], [3, 1]),
    "oneof-negative-index": (SPACES["oneof"], [-1, 1]),
    "oneof-str-index": (SPACES["oneof"], ["0", 1]),
    "oneof-bool-index": (SPACES["oneof"], [True, [0.0, 0.0]]),
    "oneof-short": (SPACES["oneof"], [0]),
    "oneof-bad-inner": (SPACES["oneof"], [0, "x"]),
}


@pytest.mark.parametrize(
    ("space", "data"), list(MALFORMED_VALUES.values()), ids=list(MALFORMED_VALUES)
)
def test_malformed_values_raise(space: Space[Any], data: Any) -> None:
    with pytest.raises(SpaceCodecError):
        value_from_json(space, data)


UNENCODABLE_VALUES: dict[str, tuple[Space[Any], Any]] = {
    "box-strings": (BOX3, np.array(["a", "b", "c"])),
    "box-complex": (BOX3, np.zeros(3, dtype=np.complex64)),
    "discrete-float": (Discrete(3), 1.5),
    "text-bytes": (Text(3), b"ab"),
    "tuple-short": (SPACES["tuple"], (np.int64(0),)),
    "dict-missing": (Dict(a=Discrete(2), b=Discrete(2)), {"a": 0}),
    "graph-tuple": (SPACES["graph"], (np.zeros((1, 3)), None, None)),
    "oneof-index-range": (SPACES["oneof"], (7, 0)),
    "sequence-not-tuple": (SPACES["sequence"], 5),
}


@pytest.mark.parametrize(
    ("space", "value"), list(UNENCODABLE_VALUES.values()), ids=list(UNENCODABLE_VALUES)
)
def test_unencodable_values_raise(space: Space[Any], value: Any) -> None:
    with pytest.raises(SpaceCodecError):
        value_to_json(space, value)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.sampled_from(["inf", "-inf", "nan", "Box", "float32", "x"]),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(["type", "n", "start", "dtype", "shape", "low", "high", "spaces", "a"]),
            children,
            max_size=5,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(data=json_values, name=st.sampled_from(sorted(SPACES)))
def test_arbitrary_json_only_raises_space_codec_error(data: Any, name: str) -> None:
    for decode in (space_from_json, lambda d: value_from_json(SPACES[name], d)):
        with contextlib.suppress(SpaceCodecError):
            decode(data)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(SPACES)), data=st.data())
def test_mutated_descriptions_only_raise_space_codec_error(name: str, data: st.DataObject) -> None:
    description = space_to_json(SPACES[name])
    key = data.draw(st.sampled_from(sorted(description)))
    description[key] = data.draw(json_values)
    with contextlib.suppress(SpaceCodecError):
        space_from_json(description)


@pytest.mark.parametrize(
    "space",
    [
        Discrete(2),
        Discrete(5, start=-2),
        Discrete(3, dtype=np.int8),
        Discrete(300, start=10, dtype=np.uint16),
    ],
)
def test_space_contains_answers_as_discrete_contains(space):
    decoded = []
    for data in range(-5, 320):
        with contextlib.suppress(Exception):
            decoded.append(value_from_json(space, data))
    others = [1, np.int32(1), np.int64(-3), np.float64(1.0), "1", np.array(1), True, None]
    for value in [*decoded, *others]:
        assert space_contains(space, value) == space.contains(value), (space, value)


def test_space_contains_defers_to_other_spaces():
    box = Box(0.0, 1.0, (2,), np.float32)
    assert space_contains(box, np.array([0.5, 0.5], np.float32))
    assert not space_contains(box, np.array([2.0, 0.5], np.float32))
