"""The reply parser of the asyncio client's HTTP/1.1 connection (`gym_sessions.client.http11`)."""

from __future__ import annotations

import pytest

from gym_sessions.client.http11 import _parse_reply

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"


def parse(raw: bytes):
    return _parse_reply(bytearray(raw), None)


def test_a_reply_with_a_length_and_what_follows_it():
    raw = HEAD + b"content-length: 2\r\n\r\n{}" + b"HTTP/1.1 204"
    (status, headers, body), used = parse(raw)
    assert (status, body) == (200, b"{}") and used == len(raw) - len(b"HTTP/1.1 204")
    assert ("content-type", "application/json") in headers


@pytest.mark.parametrize("cut", [5, len(HEAD) + 10, len(HEAD) + 22])
def test_a_partial_reply_waits_for_more(cut):
    raw = HEAD + b"content-length: 2\r\n\r\n{}"
    assert parse(raw[:cut]) is None


def test_a_chunked_reply():
    raw = HEAD + b"transfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"
    (status, _, body), used = parse(raw)
    assert (status, body, used) == (200, b"abcde", len(raw))
    assert parse(raw[:-2]) is None


def test_replies_without_a_body():
    (status, _, body), _ = parse(b"HTTP/1.1 204 No Content\r\n\r\n")
    assert (status, body) == (204, b"")


@pytest.mark.parametrize(
    "raw",
    [
        b"SSH-2.0-OpenSSH\r\n\r\n",
        HEAD + b"\r\n{}",  # no length on a kept-alive connection
        HEAD + b"content-length: x\r\n\r\n",
        b"HTTP/1.1 abc\r\n\r\n",
    ],
)
def test_what_is_no_reply_is_refused(raw):
    with pytest.raises(ValueError):
        parse(raw)


def test_a_huge_head_is_refused():
    with pytest.raises(ValueError, match="too large"):
        parse(b"HTTP/1.1 200 OK\r\n" + b"x: y\r\n" * 20000)
