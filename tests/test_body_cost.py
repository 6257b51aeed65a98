"""`body_cost` bounds from above what a body takes once parsed, for every kind of body.

The measured cost is the body's bytes plus the peak tracemalloc sees while the
worker's own parser (`gym_sessions.strict_json.loads`) runs, the result alive.
"""

from __future__ import annotations

import json
import tracemalloc

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from gym_sessions import strict_json
from gym_sessions.routing.body_budget import body_cost
from gym_sessions.spaces.binary import frame

SIZE = 1 << 18


def _repeat(item: bytes, last: bytes, *, open_: bytes = b"[", close: bytes = b"]") -> bytes:
    return open_ + item * (SIZE // len(item)) + last + close


def _keys() -> bytes:
    return b"{" + b",".join(b'"k%d":1' % i for i in range(SIZE // 10)) + b"}"


BODIES = {
    "empty objects": _repeat(b"{},", b"{}"),
    "empty lists": _repeat(b"[],", b"[]"),
    "objects with a key": _repeat(b'{"a":1},', b'{"a":1}'),
    "many keys": _keys(),
    "pairs of floats": _repeat(b"[0.12, 0.34], ", b"[0.1,0.2]"),
    "floats": _repeat(b"0.5,", b"1"),
    "small ints": _repeat(b"1,", b"1"),
    "large ints": _repeat(b"123456789012,", b"1"),
    "short strings": _repeat(b'"abcdefgh",', b'"a"'),
    "null and true": _repeat(b"null,", b"true"),
    "one long string": b'"' + b"x" * SIZE + b'"',
    "ASCII widened by one emoji": b'"' + b"x" * SIZE + "\U0001f600".encode() + b'"',
    "ASCII widened by an escape": b'"' + b"x" * SIZE + b'\\ud83d\\ude00"',
    "nested lists": b"[" * 900 + b"]" * 900,
    "a step batch": json.dumps(
        {"entries": [{"session": f"s{i}", "action": [0.5, -1.25]} for i in range(SIZE // 40)]}
    ).encode(),
    "UTF-16": json.dumps(["abc"] * (SIZE // 16)).encode("utf-16"),
}


def _parsed_cost(body: bytes) -> int:
    tracemalloc.start()
    try:
        value = strict_json.loads(body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del value
    return len(body) + peak


@pytest.mark.parametrize("kind", list(BODIES))
def test_the_cost_bounds_the_parse_from_above_within_a_small_factor(kind):
    body = BODIES[kind]
    actual, estimated = _parsed_cost(body), body_cost(body)
    assert actual <= estimated, (kind, actual / len(body), estimated / len(body))
    if kind not in ("small ints", "null and true", "ASCII widened by an escape", "UTF-16"):
        assert estimated <= 2.5 * actual, (kind, actual / len(body), estimated / len(body))


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=400,
)


@settings(max_examples=30, deadline=None)
@given(_json_values, st.booleans())
def test_the_cost_bounds_any_json_value(value, pretty):
    body = json.dumps(value, indent=1 if pretty else None, ensure_ascii=False).encode()
    assert _parsed_cost(body) <= body_cost(body)


def test_a_binary_frame_is_bounded_too():
    # Its blobs are not JSON: their bytes only add (one copy each at most is made).
    head = json.dumps({"action": {"tree": {"buffer": 0, "dtype": "|u1", "shape": [SIZE]}}})
    body = frame(head.encode(), [bytes(range(256)) * (SIZE // 256)])
    assert body_cost(body) >= 3 * len(body)
