"""`JSONReply` renders what Starlette's ``JSONResponse`` renders, with one encoder."""

import math

import pytest
from starlette.responses import JSONResponse

from gym_sessions.server.replies import JSONReply


@pytest.mark.parametrize(
    "content",
    [
        {"observation": [1, -2], "reward": 0.5, "terminated": False, "info": {}},
        {"é": ["x\u2028", None, 1e300, -0.0], "nested": {"a": [[], {}]}},
        [],
        "text",
        3,
        None,
    ],
)
def test_same_bytes_and_headers_as_json_response(content):
    ours, starlettes = JSONReply(content), JSONResponse(content)
    assert ours.body == starlettes.body
    assert ours.raw_headers == starlettes.raw_headers


@pytest.mark.parametrize("content", [math.nan, {"reward": math.inf}, [-math.inf]])
def test_nan_and_infinity_are_refused_as_json_response_refuses_them(content):
    with pytest.raises(ValueError):
        JSONResponse(content)
    with pytest.raises(ValueError):
        JSONReply(content)
