"""Signed cookies and tokens: round trips, tampering, other keys, expiry."""

import itsdangerous.timed
import pytest

from gym_sessions.credentials import COOKIE_MAX_AGE_SECONDS, SessionCredentials

CREDENTIALS = SessionCredentials("secret-one-" + "x" * 20, "gym_session")
OTHER = SessionCredentials("secret-two-" + "y" * 20, "gym_session")


def test_cookie_and_token_round_trip():
    assert CREDENTIALS.decode_cookie(CREDENTIALS.encode_cookie({"session_id": "a"})) == {
        "session_id": "a"
    }
    assert CREDENTIALS.read_token(CREDENTIALS.mint_token("a")) == "a"


def test_other_keys_tampering_and_crossing_kinds_are_refused():
    cookie = CREDENTIALS.encode_cookie({"session_id": "a"})
    token = CREDENTIALS.mint_token("a")
    assert OTHER.decode_cookie(cookie) is None
    assert OTHER.read_token(token) is None
    assert CREDENTIALS.decode_cookie(cookie[:-2] + "xx") is None
    assert CREDENTIALS.read_token(token[:-2] + "xx") is None
    assert CREDENTIALS.read_token(cookie) is None  # a cookie never passes as a token
    assert CREDENTIALS.decode_cookie(token) is None


@pytest.mark.parametrize("kind", ["cookie", "token"])
def test_cookies_and_tokens_expire(monkeypatch, kind):
    real_time = itsdangerous.timed.time.time
    monkeypatch.setattr(
        itsdangerous.timed.time, "time", lambda: real_time() - COOKIE_MAX_AGE_SECONDS - 60
    )
    old_cookie = CREDENTIALS.encode_cookie({"session_id": "a"})
    old_token = CREDENTIALS.mint_token("a")
    monkeypatch.setattr(itsdangerous.timed.time, "time", real_time)
    if kind == "cookie":
        assert CREDENTIALS.decode_cookie(old_cookie) is None
    else:
        assert CREDENTIALS.read_token(old_token) is None
