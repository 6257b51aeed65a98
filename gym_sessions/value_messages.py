"""Bodies and replies that carry space values: JSON, or binary when asked; shared by both sides.

The routes that carry observations or actions (docs/design.md §3.15) speak
JSON unless a request asks otherwise, so curl, MCP and LLM tool calls see
exactly the JSON of §3.2. A request body in the binary encoding says so in
its ``Content-Type``, a client that wants binary replies in its ``Accept``;
``GET /spaces`` offers the encoding (`binary_offer`), and the project's
clients use it whenever it is offered.

A binary message is a frame (`gym_sessions.spaces.binary.frame`: a JSON
head, then raw blobs, each at an 8-aligned offset) whose head is the JSON
object the route would send, except that each space value at the route's
value positions is an object ``{"tree": T, "buffers": [i, ...]}``: ``T`` is
the value as `gym_sessions.spaces.binary.value_to_tree` writes it (its JSON
with each array a reference ``{"buffer": k, "dtype": "<f4", "shape": [84,
84]}``), and array ``k`` holds the bytes of blob ``buffers[k]`` of the frame.
Every blob belongs to exactly one array of one value. The value positions
(`ValuePositions`):

=====================================  ==============================
message                                space values
=====================================  ==============================
``/step`` body                         ``action``
``/step_batch`` body                   ``entries[*].action``
``/reset``, ``/seed_session``,         ``observation``
``/step``, ``/observe`` replies
``/step_batch`` reply                  ``results[*].observation``
=====================================  ==============================

Error replies are always the JSON body of §3.7.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gymnasium.spaces import Space

from gym_sessions.errors import InvalidBinaryError, UnsupportedMediaTypeError
from gym_sessions.spaces import SpaceCodecError, space_from_json, space_to_json
from gym_sessions.spaces.binary import Buffer, frame, unframe, value_to_tree
from gym_sessions.spaces.values import value_to_json

__all__ = [
    "BATCH_BODY",
    "BATCH_REPLY",
    "BINARY_ACCEPT",
    "BINARY_MEDIA_TYPE",
    "BINARY_TYPE",
    "BINARY_VERSION",
    "OFFER_FIELD",
    "STEP_BODY",
    "VALUE_REPLY",
    "BinaryValue",
    "Encoding",
    "SpaceValue",
    "ValuePositions",
    "binary_offer",
    "body_encoding",
    "body_encoding_of",
    "decode_message",
    "encode_message",
    "json_content",
    "offers_binary",
    "reply_encoding",
    "reply_encoding_of",
]

#: The binary encoding's media type and version (``v`` parameter).
BINARY_TYPE = "application/vnd.gym-sessions.values"
BINARY_VERSION = 1
#: ``Content-Type`` of a binary message.
BINARY_MEDIA_TYPE = f"{BINARY_TYPE}; v={BINARY_VERSION}"
#: What the project's clients send as ``Accept`` once the server offers binary.
BINARY_ACCEPT = f"{BINARY_MEDIA_TYPE}, application/json; q=0.5"
#: The ``GET /spaces`` field that offers the encoding.
OFFER_FIELD = "binary_values"

_HEAD_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class Encoding(enum.Enum):
    """How one message's values travel."""

    JSON = "json"
    BINARY = "binary"


def binary_offer() -> dict[str, Any]:
    """The value of `OFFER_FIELD` in ``GET /spaces``: the media type and its versions."""
    return {"media_type": BINARY_TYPE, "versions": [BINARY_VERSION]}


def offers_binary(spaces_reply: Mapping[str, Any]) -> bool:
    """Whether a ``GET /spaces`` reply offers this client's binary version."""
    offer = spaces_reply.get(OFFER_FIELD)
    return (
        isinstance(offer, dict)
        and offer.get("media_type") == BINARY_TYPE
        and isinstance(offer.get("versions"), list)
        and BINARY_VERSION in offer["versions"]
    )


def _media_type(value: str) -> tuple[str, dict[str, str]]:
    """``type/subtype`` (lower case) and the parameters of one media type."""
    kind, *params = value.split(";")
    parsed: dict[str, str] = {}
    for param in params:
        name, _, text = param.partition("=")
        parsed[name.strip().lower()] = text.strip().strip('"')
    return kind.strip().lower(), parsed


def _text(value: str | bytes | None) -> str | None:
    return value.decode("latin-1") if isinstance(value, bytes) else value


@functools.lru_cache(maxsize=64)  # a client sends the same few values again and again
def body_encoding(content_type: str | bytes | None) -> Encoding:
    """The encoding of a request body by its ``Content-Type``: JSON unless it names binary.

    Any other content type (none, ``application/json``, curl's form type) is
    read as JSON, as before the binary encoding existed.

    Raises:
        UnsupportedMediaTypeError: the binary type without ``v=1``.
    """
    text = _text(content_type)
    if text is None or BINARY_TYPE not in text.lower():
        return Encoding.JSON
    kind, params = _media_type(text)
    if kind != BINARY_TYPE:
        return Encoding.JSON
    if params.get("v") != str(BINARY_VERSION):
        raise UnsupportedMediaTypeError(
            f"this server speaks {BINARY_TYPE} version {BINARY_VERSION} only "
            f"(Content-Type: {BINARY_MEDIA_TYPE}), not v={params.get('v')!r:.20}"
        )
    return Encoding.BINARY


@functools.lru_cache(maxsize=64)
def reply_encoding(accept: str | bytes | None) -> Encoding:
    """The encoding of a reply by the request's ``Accept``: binary if it lists ``v=1`` (q > 0)."""
    text = _text(accept)
    if text is None or BINARY_TYPE not in text.lower():
        return Encoding.JSON
    for item in text.split(","):
        kind, params = _media_type(item)
        if kind == BINARY_TYPE and params.get("v") == str(BINARY_VERSION):
            try:
                if float(params.get("q", "1")) > 0:
                    return Encoding.BINARY
            except ValueError:
                continue
    return Encoding.JSON


def _scope_header(scope: Mapping[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def body_encoding_of(scope: Mapping[str, Any]) -> Encoding:
    """`body_encoding` of an ASGI request (its raw headers: no Headers object per request)."""
    return body_encoding(_scope_header(scope, b"content-type"))


def reply_encoding_of(scope: Mapping[str, Any]) -> Encoding:
    """`reply_encoding` of an ASGI request."""
    return reply_encoding(_scope_header(scope, b"accept"))


class BinaryValue:
    """One space value of a binary message, not yet decoded: its tree and its buffers."""

    __slots__ = ("buffers", "tree")

    def __init__(self, tree: Any, buffers: list[Buffer]) -> None:
        self.tree = tree
        self.buffers = buffers

    def __repr__(self) -> str:
        size = sum(len(buffer) for buffer in self.buffers)
        return f"<binary value: {len(self.buffers)} buffers, {size} bytes>"


class SpaceValue:
    """A value of ``space`` in a reply, encoded when the reply is (each encoding once).

    It pickles as the space's JSON description and the value (a session's
    snapshot holds it), not as the space object with its bounds' arrays.
    """

    __slots__ = ("_binary", "_json", "space", "value")
    _UNSET: Any = object()

    def __init__(self, space: Space[Any], value: Any) -> None:
        self.space = space
        self.value = value
        self._json: Any = SpaceValue._UNSET
        self._binary: BinaryValue | None = None

    def to_json(self) -> Any:
        """The value as `value_to_json` writes it."""
        if self._json is SpaceValue._UNSET:
            self._json = value_to_json(self.space, self.value)
        return self._json

    def to_binary(self) -> BinaryValue:
        """The value's tree and buffers (`value_to_tree`)."""
        if self._binary is None:
            self._binary = BinaryValue(*value_to_tree(self.space, self.value))
        return self._binary

    def __reduce__(self) -> tuple[Any, ...]:
        return _restore_space_value, (space_to_json(self.space), self.value)

    def __repr__(self) -> str:
        return f"SpaceValue({self.space!r:.60}, {self.value!r:.60})"


def _restore_space_value(space: Any, value: Any) -> SpaceValue:
    return SpaceValue(space_from_json(space), value)


@dataclass(frozen=True)
class ValuePositions:
    """Where a message's space values stand: ``field`` of the head, or of each ``within[*]``."""

    field: str
    within: str | None = None

    def describe(self) -> str:
        return self.field if self.within is None else f"{self.within}[*].{self.field}"


STEP_BODY = ValuePositions("action")
BATCH_BODY = ValuePositions("action", "entries")
VALUE_REPLY = ValuePositions("observation")
BATCH_REPLY = ValuePositions("observation", "results")


def _holders(head: Mapping[str, Any], positions: ValuePositions) -> list[Any]:
    """The objects that may hold a value at ``positions`` (the head, or its list's items)."""
    if positions.within is None:
        return [head]
    items = head.get(positions.within)
    return items if isinstance(items, list) else []


_VALUES = (SpaceValue, BinaryValue)


def _encoded(value: Any, blobs: list[Buffer]) -> Any:
    if isinstance(value, SpaceValue):
        value = value.to_binary()
    elif not isinstance(value, BinaryValue):
        return value
    first = len(blobs)
    blobs.extend(value.buffers)
    return {"tree": value.tree, "buffers": list(range(first, len(blobs)))}


def encode_message(head: Mapping[str, Any], positions: ValuePositions) -> bytes:
    """``head`` as a binary message: its `SpaceValue` and `BinaryValue` objects at
    ``positions`` become value objects, their buffers the frame's blobs, in order;
    any other field is written as JSON.

    Raises:
        SpaceCodecError: a value does not have the structure of its space.
        ValueError: a field is not JSON (NaN, say).
    """
    blobs: list[Buffer] = []
    name = positions.field
    out: Mapping[str, Any] = head
    if positions.within is None:
        value = head.get(name)
        if isinstance(value, _VALUES):
            out = {**head, name: _encoded(value, blobs)}
    else:
        items = head.get(positions.within)
        if isinstance(items, list):
            out = {
                **head,
                positions.within: [
                    {**item, name: _encoded(item[name], blobs)}
                    if isinstance(item, dict) and name in item
                    else item
                    for item in items
                ],
            }
    return frame(_HEAD_ENCODER.encode(out).encode(), blobs)


def json_content(content: Mapping[str, Any], positions: ValuePositions) -> dict[str, Any]:
    """``content`` with each `SpaceValue` at ``positions`` as its JSON (other fields as is)."""
    name = positions.field
    if positions.within is None:
        value = content.get(name)
        if isinstance(value, SpaceValue):
            return {**content, name: value.to_json()}
        return dict(content)
    items = content.get(positions.within)
    if not isinstance(items, list):
        return dict(content)
    return {
        **content,
        positions.within: [
            {**item, name: item[name].to_json()}
            if isinstance(item, dict) and isinstance(item.get(name), SpaceValue)
            else item
            for item in items
        ],
    }


def decode_message(data: Buffer, positions: ValuePositions) -> dict[str, Any]:
    """The head of a binary message, each value object at ``positions`` a `BinaryValue`.

    The buffers are views of ``data``, not copies. A field at ``positions``
    must be a value object ``{"tree", "buffers"}`` when present; every blob
    must belong to exactly one value.

    Raises:
        InvalidBinaryError: the message is malformed (frame, head, value objects).
    """
    view = data if isinstance(data, memoryview) else memoryview(data)
    try:
        head, blobs = unframe(view, "message")
    except SpaceCodecError as exc:
        raise InvalidBinaryError(f"the body is not a binary message: {exc}") from exc
    if not isinstance(head, dict):
        raise InvalidBinaryError("the head of a binary message must be a JSON object")
    named = bytearray(len(blobs))  # 1 once a value names the blob
    name = positions.field
    if positions.within is None:
        if name in head:
            head[name] = _take(head[name], blobs, named, name)
    else:
        for i, item in enumerate(_holders(head, positions)):
            if isinstance(item, dict) and name in item:
                item[name] = _take(item[name], blobs, named, f"{positions.within}[{i}].{name}")
    if blobs and not all(named):
        raise InvalidBinaryError(
            f"blob {named.index(0)} belongs to no value at {positions.describe()}"
        )
    return head


def _take(value: Any, blobs: list[memoryview], named: bytearray, where: str) -> BinaryValue:
    """The `BinaryValue` a value object names; its blobs are marked as named."""
    if type(value) is not dict or len(value) != 2 or "tree" not in value:
        raise InvalidBinaryError(f'{where} must be a value object {{"tree", "buffers"}}')
    indices = value.get("buffers")
    if type(indices) is not list:
        raise InvalidBinaryError(f"{where}.buffers must be a list of blob numbers")
    count = len(blobs)
    for index in indices:
        if type(index) is not int or not 0 <= index < count or named[index]:
            raise InvalidBinaryError(
                f"{where}.buffers: blob {index!r:.20} does not exist or is named twice"
            )
        named[index] = 1
    return BinaryValue(value["tree"], [blobs[index] for index in indices])
