"""`JSONReply` renders what Starlette's ``JSONResponse`` renders, with one encoder."""

import math

import pytest
from starlette.responses import JSONResponse

from gym_sessions.server.replies import JSONReply, send_json_reply


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


@pytest.mark.parametrize("content", [{"observation": [1, -2], "reward": 0.5}, {"é": "x\u2028"}, []])
async def test_send_json_reply_sends_what_json_reply_sends(content):
    ours: list[dict] = []
    starlettes: list[dict] = []

    async def into(sent: list[dict]):
        async def send(message: dict) -> None:
            sent.append(message)

        return send

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    await send_json_reply(await into(ours), content)
    await JSONReply(content)({"type": "http"}, receive, await into(starlettes))
    assert ours == starlettes


async def test_send_json_reply_refuses_nan_before_sending_anything():
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    with pytest.raises(ValueError):
        await send_json_reply(send, {"reward": math.nan})
    assert sent == []
