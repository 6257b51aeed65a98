"""Request bodies: JSON parsing and a small schema per route.

A `BodySchema` validates a route's JSON object and describes it as JSON Schema,
so the same declaration checks HTTP bodies and, later, MCP tool inputs. Routes
that carry space values also take binary messages (`read_value_body`,
`gym_sessions.value_messages`); every other route refuses them (415).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from gym_sessions import strict_json
from gym_sessions.errors import InvalidJSONError, InvalidRequestError, UnsupportedMediaTypeError
from gym_sessions.routing.request_session import REQUEST_SESSION_KEY
from gym_sessions.routing.session_ids import route_path
from gym_sessions.value_messages import Encoding, ValuePositions, body_encoding_of, decode_message

__all__ = ["BodySchema", "Field", "integer_list", "read_json", "read_value_body"]


def _is_finite_number(value: Any) -> bool:
    """A JSON number a float can hold: no bool, no NaN or infinity, no 10**400."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False


_CHECKS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: _is_finite_number(v),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}


def integer_list(value: Any) -> bool:
    """Whether ``value`` is a list of JSON integers."""
    return isinstance(value, list) and all(_CHECKS["integer"](item) for item in value)


@dataclass(frozen=True)
class Field:
    """One body field: its JSON types (empty means any) and whether it is required."""

    types: tuple[str, ...] = ()
    required: bool = False
    description: str = ""
    schema: dict[str, Any] | None = None  # a richer JSON Schema, e.g. an action space's

    def accepts(self, value: Any) -> bool:
        return not self.types or any(_CHECKS[t](value) for t in self.types)


@dataclass(frozen=True)
class BodySchema:
    """The JSON object a route accepts.

    Attributes:
        fields: Known fields.
        allow_extra: Whether unknown fields are accepted (task data, say).
    """

    fields: dict[str, Field] = field(default_factory=dict)
    allow_extra: bool = False

    def validate(self, body: Any) -> dict[str, Any]:
        """``body`` if it fits; raises `InvalidRequestError` naming what does not."""
        if body is None:
            body = {}
        if not isinstance(body, dict):
            raise InvalidRequestError(f"body must be a JSON object, not {type(body).__name__}")
        for name, spec in self.fields.items():
            if name not in body:
                if spec.required:
                    raise InvalidRequestError(f"body is missing the field {name!r}")
                continue
            if not spec.accepts(body[name]):
                raise InvalidRequestError(
                    f"field {name!r} must be {' or '.join(spec.types)}, "
                    f"not {type(body[name]).__name__}"
                )
        if not self.allow_extra:
            unknown = sorted(set(body) - set(self.fields))
            if unknown:
                raise InvalidRequestError(f"unknown field(s): {', '.join(map(repr, unknown))}")
        return body

    def json_schema(self) -> dict[str, Any]:
        """This schema as JSON Schema."""
        properties: dict[str, Any] = {}
        for name, spec in self.fields.items():
            prop = dict(spec.schema) if spec.schema else {}
            if spec.types and not spec.schema:
                prop["type"] = list(spec.types) if len(spec.types) > 1 else spec.types[0]
            if spec.description:
                prop["description"] = spec.description
            properties[name] = prop
        schema: dict[str, Any] = {"type": "object", "properties": properties}
        required = [name for name, spec in self.fields.items() if spec.required]
        if required:
            schema["required"] = required
        schema["additionalProperties"] = self.allow_extra
        return schema


async def _raw_body(request: Request) -> bytes:
    routed = request.scope.get(REQUEST_SESSION_KEY)
    if routed is not None and routed.body is not None:
        return routed.body
    return await request.body()


async def read_value_body(request: Request, positions: ValuePositions) -> Any:
    """The request's body, JSON or a binary message by its ``Content-Type``.

    A binary message comes back as its head, with a `BinaryValue` for each space
    value at ``positions`` (`decode_message`).

    Raises:
        InvalidBinaryError: a malformed binary message.
        UnsupportedMediaTypeError: a binary version this server does not speak.
    """
    if body_encoding_of(request.scope) is Encoding.JSON:
        return await _read_json(request)
    return decode_message(await _raw_body(request), positions)


async def read_json(request: Request) -> Any:
    """The request's JSON body (``None`` when empty), parsed once.

    The router already parsed typed session starts and closes; their parse is
    reused. Other bodies are parsed from the bytes the router read. NaN and
    Infinity literals are refused, as strict JSON does.

    Raises:
        UnsupportedMediaTypeError: the body is a binary message (415).
    """
    if body_encoding_of(request.scope) is Encoding.BINARY:
        raise UnsupportedMediaTypeError(
            f"{route_path(request.scope['path'])} takes JSON bodies only"
        )
    return await _read_json(request)


async def _read_json(request: Request) -> Any:
    routed = request.scope.get(REQUEST_SESSION_KEY)
    raw: bytes | None = None
    if routed is not None:
        if routed.has_json_body:
            return routed.json_body
        raw = routed.body
    if raw is None:
        raw = await request.body()
    if not raw.strip():
        return None
    try:
        return strict_json.loads(raw)
    except ValueError as exc:
        raise InvalidJSONError(f"request body is not valid JSON: {exc}") from exc
