"""Request bodies (`gym_sessions.server.bodies`), in process: schemas, their errors, JSON parsing.

Every refusal is the project's own `InvalidRequestError` (400 ``invalid_request``)
or, for a body that is not JSON at all, `InvalidJSONError` (400 ``invalid_json``);
the exact class matters, since the client maps the code back to it.
"""

from __future__ import annotations

from typing import Any

import pytest
from starlette.requests import Request

from gym_sessions.errors import InvalidJSONError, InvalidRequestError, error_body
from gym_sessions.routing.request_session import REQUEST_SESSION_KEY, RequestSession
from gym_sessions.routing.session_ids import IdSource
from gym_sessions.server.bodies import BodySchema, Field, integer_list, read_json
from gym_sessions.server.resources import AGGREGATE_BODY, CLOSE_BODY, SEED_BODY

STEP = BodySchema({"action": Field(required=True)})
TYPED = BodySchema(
    {
        "n": Field(("integer",)),
        "x": Field(("number",)),
        "s": Field(("string",)),
        "b": Field(("boolean",)),
        "o": Field(("object",)),
        "a": Field(("array",)),
        "z": Field(("null",)),
        "maybe": Field(("integer", "null")),
    }
)


def refusal(schema: BodySchema, body: Any) -> str:
    """The message of ``schema``'s refusal of ``body``, checked to be a 400 invalid_request."""
    with pytest.raises(InvalidRequestError) as caught:
        schema.validate(body)
    error = caught.value
    assert type(error) is InvalidRequestError
    assert (error.status, error.code) == (400, "invalid_request")
    return error.message


# What a schema accepts ---------------------------------------------------------------------


def test_a_body_that_fits_is_returned_as_is():
    body = {"n": 3, "x": 2.5, "s": "", "b": False, "o": {}, "a": [], "z": None, "maybe": None}
    assert TYPED.validate(body) is body


def test_no_body_is_an_empty_object():
    assert TYPED.validate(None) == {}
    assert BodySchema().validate(None) == {}


def test_optional_fields_may_be_absent():
    assert TYPED.validate({"s": "only"}) == {"s": "only"}


def test_a_field_without_types_takes_any_json_value():
    for value in (None, 0, -1.5, "x", True, [1, [2]], {"k": {}}):
        assert STEP.validate({"action": value}) == {"action": value}


def test_allow_extra_keeps_unknown_fields():
    schema = BodySchema({"seed": Field(("integer",))}, allow_extra=True)
    body = {"seed": 1, "task": {"goal": 3}, "anything": [1]}
    assert schema.validate(body) == body


def test_integers_are_numbers_but_not_the_reverse():
    assert TYPED.validate({"x": 7}) == {"x": 7}
    assert TYPED.validate({"x": 10**300}) == {"x": 10**300}
    assert refusal(TYPED, {"n": 7.0}) == "field 'n' must be integer, not float"


# What it refuses, and how it says so ------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [[], [{"n": 1}], "text", 3, 2.5, True, False],
)
def test_a_body_that_is_not_an_object_is_refused(body):
    assert refusal(TYPED, body) == f"body must be a JSON object, not {type(body).__name__}"


def test_a_missing_required_field_is_named():
    assert refusal(STEP, {}) == "body is missing the field 'action'"
    assert refusal(STEP, None) == "body is missing the field 'action'"


def test_a_required_field_set_to_null_is_present():
    assert STEP.validate({"action": None}) == {"action": None}
    required_int = BodySchema({"k": Field(("integer",), required=True)})
    assert refusal(required_int, {"k": None}) == "field 'k' must be integer, not NoneType"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n", True, "field 'n' must be integer, not bool"),
        ("n", "3", "field 'n' must be integer, not str"),
        ("n", None, "field 'n' must be integer, not NoneType"),
        ("x", False, "field 'x' must be number, not bool"),
        ("x", "1.5", "field 'x' must be number, not str"),
        ("s", 1, "field 's' must be string, not int"),
        ("s", ["a"], "field 's' must be string, not list"),
        ("b", 0, "field 'b' must be boolean, not int"),
        ("b", "true", "field 'b' must be boolean, not str"),
        ("o", [], "field 'o' must be object, not list"),
        ("a", {}, "field 'a' must be array, not dict"),
        ("a", "abc", "field 'a' must be array, not str"),
        ("z", 0, "field 'z' must be null, not int"),
        ("maybe", 1.5, "field 'maybe' must be integer or null, not float"),
        ("maybe", False, "field 'maybe' must be integer or null, not bool"),
    ],
)
def test_a_field_of_the_wrong_type_is_named_with_its_types(field, value, message):
    assert refusal(TYPED, {field: value}) == message


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), float("-inf"), 10**400, -(10**400)],
)
def test_numbers_a_float_cannot_hold_are_refused(value):
    # NaN literals never parse; 1e400 parses to inf and 10**400 stays an int.
    assert refusal(TYPED, {"x": value}) == f"field 'x' must be number, not {type(value).__name__}"


def test_unknown_fields_are_all_named_in_order():
    body = {"zeta": 1, "n": 1, "alpha": 2, "mu": 3, "beta": 4, "omega": 5}
    assert refusal(TYPED, body) == "unknown field(s): 'alpha', 'beta', 'mu', 'omega', 'zeta'"


def test_a_schema_without_fields_refuses_any_field():
    assert BodySchema().validate({}) == {}
    assert refusal(BodySchema(), {"x": 1}) == "unknown field(s): 'x'"


def test_fields_are_checked_in_declaration_order_before_unknown_ones():
    body = {"unknown": 1, "s": 2, "n": "3"}
    assert refusal(TYPED, body) == "field 'n' must be integer, not str"
    two_required = BodySchema({"a": Field(required=True), "b": Field(required=True)})
    assert refusal(two_required, {"extra": 1}) == "body is missing the field 'a'"


def test_a_refusal_renders_as_the_json_error_body():
    with pytest.raises(InvalidRequestError) as caught:
        STEP.validate({})
    assert error_body(caught.value) == (
        b'{"error": {"code": "invalid_request", "message": "body is missing the field \'action\'"}}'
    )


# The project's own route schemas -----------------------------------------------------------


def test_a_start_body_takes_task_data_but_checks_its_known_fields():
    body = {"seed": 3, "options": None, "task": {"goal": 1}, "render_mode": "ansi"}
    assert SEED_BODY.validate(body) == body
    assert refusal(SEED_BODY, {"seed": "3"}) == "field 'seed' must be integer or null, not str"
    assert refusal(SEED_BODY, {"seed": 1.0}) == "field 'seed' must be integer or null, not float"
    assert refusal(SEED_BODY, {"options": []}) == "field 'options' must be object or null, not list"
    assert (
        refusal(SEED_BODY, {"mcp_tools": "step"})
        == "field 'mcp_tools' must be array or null, not str"
    )


def test_a_close_body_takes_only_its_id_and_key():
    assert CLOSE_BODY.validate({"resources_session_id": "s", "session_key": None}) == {
        "resources_session_id": "s",
        "session_key": None,
    }
    assert refusal(CLOSE_BODY, {"resources_session_id": 5}) == (
        "field 'resources_session_id' must be string or null, not int"
    )
    assert refusal(CLOSE_BODY, {"seed": 1}) == "unknown field(s): 'seed'"


def test_an_aggregate_body_needs_its_list():
    assert refusal(AGGREGATE_BODY, {}) == "body is missing the field 'verify_responses'"
    assert refusal(AGGREGATE_BODY, {"verify_responses": {}}) == (
        "field 'verify_responses' must be array, not dict"
    )


# JSON Schema --------------------------------------------------------------------------------


def test_json_schema_of_typed_required_and_described_fields():
    schema = BodySchema(
        {
            "id": Field(("string",), required=True, description="the id"),
            "seed": Field(("integer", "null")),
            "any": Field(),
        }
    )
    assert schema.json_schema() == {
        "type": "object",
        "properties": {
            "id": {"type": "string", "description": "the id"},
            "seed": {"type": ["integer", "null"]},
            "any": {},
        },
        "required": ["id"],
        "additionalProperties": False,
    }


def test_json_schema_without_required_fields_has_no_required_list():
    assert BodySchema(allow_extra=True).json_schema() == {
        "type": "object",
        "properties": {},
        "additionalProperties": True,
    }


def test_a_fields_own_schema_replaces_its_types_and_is_not_modified():
    action = {"type": "integer", "minimum": -10, "maximum": 10}
    schema = BodySchema(
        {"action": Field(("string",), required=True, description="an action", schema=action)}
    )
    assert schema.json_schema()["properties"]["action"] == {
        "type": "integer",
        "minimum": -10,
        "maximum": 10,
        "description": "an action",
    }
    assert action == {"type": "integer", "minimum": -10, "maximum": 10}
    # Validation still checks the declared types.
    assert refusal(schema, {"action": 3}) == "field 'action' must be string, not int"


# integer_list -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ([], True),
        ([1, -2, 10**30], True),
        ([1, True], False),
        ([1, 2.0], False),
        ([1, "2"], False),
        ([[1]], False),
        ((1, 2), False),
        ("12", False),
        (None, False),
    ],
)
def test_integer_list(value, expected):
    assert integer_list(value) is expected


# read_json ----------------------------------------------------------------------------------


def request_with_body(raw: bytes, routed: RequestSession | None = None) -> Request:
    """A Starlette request whose body arrives as ``raw`` in two ASGI messages."""
    messages = [
        {"type": "http.request", "body": raw[: len(raw) // 2], "more_body": True},
        {"type": "http.request", "body": raw[len(raw) // 2 :], "more_body": False},
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/x", "headers": []}
    if routed is not None:
        scope[REQUEST_SESSION_KEY] = routed
    return Request(scope, receive)


def routed_session() -> RequestSession:
    return RequestSession("sid", IdSource.BODY, claims_first=True, claims_on_use=False)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            b'{"seed": 1, "options": {"a": [1, 2.5, null]}}',
            {"seed": 1, "options": {"a": [1, 2.5, None]}},
        ),
        (b"[1, 2]", [1, 2]),
        (b'"text"', "text"),
        (b"null", None),
        (b'\xef\xbb\xbf{"k": "\xc3\xa9"}', {"k": "\u00e9"}),  # UTF-8 with a BOM
    ],
)
async def test_read_json_parses_any_json_value(raw, expected):
    assert await read_json(request_with_body(raw)) == expected


@pytest.mark.parametrize("raw", [b"", b"   ", b"\r\n\t "])
async def test_an_empty_body_is_none(raw):
    assert await read_json(request_with_body(raw)) is None


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{oops", "Expecting property name"),
        (b'{"a": 1} trailing', "Extra data"),
        (b'{"a": NaN}', "NaN is not valid JSON"),
        (b"Infinity", "Infinity is not valid JSON"),
        (b"[-Infinity]", "-Infinity is not valid JSON"),
        (b'{"k": "\xff"}', "codec can't decode"),
        (b"[" * 100_000 + b"]" * 100_000, "JSON nested too deeply"),
        (b"1" * 5000, "integer string conversion"),
    ],
)
async def test_a_body_that_is_not_strict_json_is_invalid_json(raw, reason):
    with pytest.raises(InvalidJSONError) as caught:
        await read_json(request_with_body(raw))
    error = caught.value
    assert (error.status, error.code) == (400, "invalid_json")
    assert error.message.startswith("request body is not valid JSON: ")
    assert reason in error.message


async def test_1e400_parses_to_infinity_which_number_fields_refuse():
    body = await read_json(request_with_body(b'{"x": 1e400}'))
    assert body == {"x": float("inf")}
    assert refusal(TYPED, body) == "field 'x' must be number, not float"


def unreadable_request(routed: Any) -> Request:
    """A routed request whose ASGI ``receive`` fails: its body must not be read again."""

    async def receive() -> dict[str, Any]:
        raise AssertionError("the body was read again")

    scope = {"type": "http", "method": "POST", "path": "/x", "headers": []}
    return Request({**scope, REQUEST_SESSION_KEY: routed}, receive)


async def test_the_routers_parse_is_reused_without_reading_the_body():
    routed = routed_session()
    parsed = {"resources_session_id": "sid"}
    routed.json_body = parsed
    request = unreadable_request(routed)
    assert await read_json(request) is parsed
    routed.json_body = None  # the router parsed an empty body
    assert await read_json(request) is None


async def test_a_routed_request_the_router_did_not_parse_is_read():
    routed = routed_session()
    assert not routed.has_json_body
    assert await read_json(request_with_body(b'{"k": 1}', routed)) == {"k": 1}


async def test_the_body_the_router_read_is_parsed_without_reading_it_again():
    routed = routed_session()
    routed.body = b'{"action": 3}'
    request = unreadable_request(routed)
    assert await read_json(request) == {"action": 3}
    routed.body = b" "
    assert await read_json(request) is None
