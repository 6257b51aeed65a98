"""`space_json_schema`: the JSON Schema of a space's JSON values (tool parameters).

Every encoded sample of a space must validate against its schema, and the
spaces whose schema is exact must reject values outside them.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import numpy as np
import pytest
from gymnasium.spaces import (
    Box,
    Dict,
    Discrete,
    Graph,
    MultiBinary,
    MultiDiscrete,
    Sequence,
    Space,
    Text,
    Tuple,
)

from gym_sessions.spaces import space_json_schema, value_to_json

SPACES: dict[str, Space[Any]] = {
    "discrete": Discrete(5, start=-2),
    "box_bounded": Box(-1.0, 2.0, (2, 3), np.float32),
    "box_unbounded": Box(-np.inf, np.inf, (4,), np.float64),
    "box_half_bounded": Box(0.0, np.inf, (2,), np.float32),
    "box_per_element": Box(np.array([0.0, -1.0]), np.array([1.0, 5.0]), dtype=np.float64),
    "box_int": Box(-3, 7, (2, 2), np.int16),
    "box_bool": Box(0, 1, (3,), np.bool_),
    "multi_discrete": MultiDiscrete([3, 4, 5]),
    "multi_binary": MultiBinary([2, 3]),
    "text": Text(5, min_length=1, charset="abc"),
    "tuple": Tuple((Discrete(2), Box(0.0, 1.0, (2,), np.float32))),
    "dict": Dict({"a": Discrete(3), "b": Text(4)}),
    "sequence": Sequence(Discrete(3)),
    "graph": Graph(Box(0.0, 1.0, (2,), np.float32), Discrete(2)),
}


def validator(space: Space[Any]) -> Any:
    schema = space_json_schema(space)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize("name", sorted(SPACES))
def test_every_encoded_sample_fits_the_schema(name):
    space = SPACES[name]
    space.seed(0)
    check = validator(space)
    for _ in range(20):
        check.validate(value_to_json(space, space.sample()))


@pytest.mark.parametrize(
    ("name", "outside"),
    [
        ("discrete", 3),
        ("discrete", -3),
        ("box_bounded", [[0.0, 0.0, 0.0]]),
        ("box_bounded", [[0.0, 0.0, 3.0], [0.0, 0.0, 0.0]]),
        ("box_half_bounded", [-1.0, 0.0]),
        ("box_int", [[0, 0], [0, 8]]),
        ("box_int", [[0, 0], [0, 0.5]]),
        ("box_bool", [True, 1, False]),
        ("multi_discrete", [0, 0]),
        ("multi_binary", [[0, 1], [1, 0, 2]]),
        ("text", ""),
        ("text", "abcabc"),
        ("tuple", [1]),
        ("dict", {"a": 1}),
        ("dict", {"a": 1, "b": "x", "c": 0}),
    ],
)
def test_exact_schemas_reject_values_outside_the_space(name, outside):
    assert not validator(SPACES[name]).is_valid(outside)


def test_non_finite_floats_travel_as_strings_where_unbounded():
    check = validator(SPACES["box_unbounded"])
    assert check.is_valid(["inf", "-inf", "nan", 1.5])
    assert not check.is_valid(["infinity", 0.0, 0.0, 0.0])


def test_shapes_and_bounds_are_spelled_out():
    assert space_json_schema(Discrete(5, start=-2)) == {
        "type": "integer",
        "minimum": -2,
        "maximum": 2,
    }
    assert space_json_schema(Box(-1.0, 2.0, (2,), np.float32)) == {
        "type": "array",
        "items": {"type": "number", "minimum": -1.0, "maximum": 2.0},
        "minItems": 2,
        "maxItems": 2,
    }


@pytest.mark.parametrize("name", ["sequence", "graph"])
def test_spaces_without_an_exact_schema_accept_any_json(name):
    assert space_json_schema(SPACES[name]) == {}
