"""Signed cookies, opaque tokens and session-key digests: round trips, tampering, expiry."""

import base64
import binascii
import contextlib
import time

import itsdangerous.timed
import pytest

from gym_sessions.credentials import (
    CLOCK_SKEW_SECONDS,
    COOKIE_MAX_AGE_SECONDS,
    SessionCredentials,
    SessionToken,
)

CREDENTIALS = SessionCredentials("secret-one-" + "x" * 20, "gym_session")
OTHER = SessionCredentials("secret-two-" + "y" * 20, "gym_session")


def test_cookie_and_token_round_trip():
    assert CREDENTIALS.decode_cookie(CREDENTIALS.encode_cookie({"session_id": "a"})) == {
        "session_id": "a"
    }
    assert CREDENTIALS.read_token(CREDENTIALS.mint_token("a", "n1")) == SessionToken("a", "n1")
    limited = CREDENTIALS.mint_token("a", "n1", frozenset({"observe"}))
    assert CREDENTIALS.read_token(limited) == SessionToken("a", "n1", frozenset({"observe"}))


def _decodings(text: str) -> list[bytes]:
    """Every base64 / base64url decoding of ``text`` and of each of its dot-separated parts."""
    found = []
    for part in [text, *text.split(".")]:
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            for pad in ("", "=", "=="):
                with contextlib.suppress(binascii.Error, ValueError):
                    found.append(decode(part + pad))
    return found


def test_tokens_are_opaque_to_their_holder():
    sid = "victim-session-0123456789abcdef"
    token = CREDENTIALS.mint_token(sid, "nonce-abcdef", frozenset({"step"}))
    assert sid not in token
    for decoded in _decodings(token):
        for secret_part in (sid, "nonce-abcdef", "step", "sid"):
            assert secret_part.encode() not in decoded
    # Two tokens of one session differ: nothing links them for an observer.
    assert CREDENTIALS.mint_token(sid, "nonce-abcdef") != CREDENTIALS.mint_token(
        sid, "nonce-abcdef"
    )


def test_other_keys_tampering_and_crossing_kinds_are_refused():
    cookie = CREDENTIALS.encode_cookie({"session_id": "a"})
    token = CREDENTIALS.mint_token("a", "n")
    assert OTHER.decode_cookie(cookie) is None
    assert OTHER.read_token(token) is None
    assert CREDENTIALS.decode_cookie(cookie[:-2] + "xx") is None
    assert CREDENTIALS.read_token(token[:-2] + "xx") is None
    assert CREDENTIALS.read_token(cookie) is None  # a cookie never passes as a token
    assert CREDENTIALS.decode_cookie(token) is None
    assert CREDENTIALS.read_token("é") is None


def test_cookies_are_itsdangerous_timestamp_signed_values_both_ways():
    # The reader keeps its own keyed HMAC; it must accept exactly what the signer makes.
    signer = itsdangerous.TimestampSigner("secret-one-" + "x" * 20)
    payload = base64.b64encode(b'{"session_id":"a","incarnation":"n"}')
    by_library = signer.sign(payload).decode()
    assert CREDENTIALS.decode_cookie(by_library) == {"session_id": "a", "incarnation": "n"}
    ours = CREDENTIALS.encode_cookie({"session_id": "a"})
    assert signer.unsign(ours) == base64.b64encode(b'{"session_id":"a"}')


def test_every_one_character_change_of_a_cookie_is_refused():
    cookie = CREDENTIALS.encode_cookie({"session_id": "a", "incarnation": "nonce"})
    for i, char in enumerate(cookie):
        for other in {"A", "b", "0", "-", "_", ".", "=", "é"} - {char}:
            changed = cookie[:i] + other + cookie[i + 1 :]
            assert CREDENTIALS.decode_cookie(changed) is None, (i, other)
        assert CREDENTIALS.decode_cookie(cookie[:i] + cookie[i + 1 :]) is None, i
    for broken in ("", ".", "..", "a.b", "a.b.c", cookie + ".", "." + cookie, cookie + "="):
        assert CREDENTIALS.decode_cookie(broken) is None, broken


def test_cookies_expire(monkeypatch):
    real_time = itsdangerous.timed.time.time
    monkeypatch.setattr(
        itsdangerous.timed.time, "time", lambda: real_time() - COOKIE_MAX_AGE_SECONDS - 60
    )
    old_cookie = CREDENTIALS.encode_cookie({"session_id": "a"})
    monkeypatch.setattr(itsdangerous.timed.time, "time", real_time)
    assert CREDENTIALS.decode_cookie(old_cookie) is None


def test_tokens_expire():
    long_ago = int(time.time()) - COOKIE_MAX_AGE_SECONDS - 60
    old = CREDENTIALS._token_cipher.encrypt_at_time(b'{"sid": "a", "inc": "n"}', long_ago)
    assert CREDENTIALS.read_token(old.decode()) is None
    fresh = CREDENTIALS._token_cipher.encrypt(b'{"sid": "a", "inc": "n"}')
    assert CREDENTIALS.read_token(fresh.decode()) == SessionToken("a", "n")


# Clock skew -----------------------------------------------------------------------------------

NOW = 1_800_000_000.25  # a fixed reader's clock, a quarter past a whole second


@pytest.fixture
def clock(monkeypatch):
    """``clock(t)`` sets ``time.time()`` (itsdangerous and Fernet read it) to ``t``."""

    def set_clock(t: float) -> None:
        monkeypatch.setattr(time, "time", lambda: t)

    return set_clock


def _cookie_and_token_minted_at(clock, t: float) -> tuple[str, str]:
    clock(t)
    cookie = CREDENTIALS.encode_cookie({"session_id": "a"})
    token = CREDENTIALS.mint_token("a", "n")
    clock(NOW)
    return cookie, token


def test_the_skew_bound_is_at_least_five_seconds():
    assert CLOCK_SKEW_SECONDS == 60  # the README and the module docstring say so
    assert CLOCK_SKEW_SECONDS >= 5


@pytest.mark.parametrize(
    "ahead",
    [0.1, 0.5, 0.75, 1, 2, 5, 30, CLOCK_SKEW_SECONDS - 0.25, CLOCK_SKEW_SECONDS + 0.5],
)
def test_credentials_from_a_host_whose_clock_is_ahead_within_the_bound_are_accepted(clock, ahead):
    # Whole seconds at both ends: up to CLOCK_SKEW_SECONDS + 0.75 s (reader at .25) passes.
    cookie, token = _cookie_and_token_minted_at(clock, NOW + ahead)
    assert CREDENTIALS.decode_cookie(cookie) == {"session_id": "a"}
    assert CREDENTIALS.read_token(token) == SessionToken("a", "n")


@pytest.mark.parametrize("ahead", [CLOCK_SKEW_SECONDS + 0.75, CLOCK_SKEW_SECONDS + 2, 3600, 10**8])
def test_credentials_from_further_in_the_future_are_refused(clock, ahead):
    cookie, token = _cookie_and_token_minted_at(clock, NOW + ahead)
    assert CREDENTIALS.decode_cookie(cookie) is None
    assert CREDENTIALS.read_token(token) is None
    # Not for good: once the reader's clock catches up they are fine.
    clock(NOW + ahead)
    assert CREDENTIALS.decode_cookie(cookie) == {"session_id": "a"}
    assert CREDENTIALS.read_token(token) == SessionToken("a", "n")


@pytest.mark.parametrize(
    ("age", "accepted"),
    [
        (COOKIE_MAX_AGE_SECONDS - 30, True),
        (COOKIE_MAX_AGE_SECONDS, True),
        (COOKIE_MAX_AGE_SECONDS + 1, False),
        # The skew does not lengthen the maximum age (whatever host minted it).
        (COOKIE_MAX_AGE_SECONDS + CLOCK_SKEW_SECONDS // 2, False),
        (COOKIE_MAX_AGE_SECONDS + CLOCK_SKEW_SECONDS, False),
    ],
)
def test_maximum_age_is_judged_on_the_readers_clock_without_skew(clock, age, accepted):
    cookie, token = _cookie_and_token_minted_at(clock, NOW - age)
    assert (CREDENTIALS.decode_cookie(cookie) is not None) is accepted
    assert (CREDENTIALS.read_token(token) is not None) is accepted


def test_a_cookie_read_before_is_judged_again_on_each_read(clock):
    # Decoding remembers verified values: their age is still checked every time,
    # and what a reader does with the data it got changes nothing for the next.
    cookie, _ = _cookie_and_token_minted_at(clock, NOW)
    first = CREDENTIALS.decode_cookie(cookie)
    assert first == {"session_id": "a"}
    first["session_id"] = "b"
    assert CREDENTIALS.decode_cookie(cookie) == {"session_id": "a"}
    clock(NOW + COOKIE_MAX_AGE_SECONDS + 1)
    assert CREDENTIALS.decode_cookie(cookie) is None
    clock(NOW)
    assert CREDENTIALS.decode_cookie(cookie[:-1] + ("A" if cookie[-1] != "A" else "B")) is None


def test_future_dated_credentials_still_need_the_secret(clock):
    cookie, token = _cookie_and_token_minted_at(clock, NOW + 10)
    assert OTHER.decode_cookie(cookie) is None
    assert OTHER.read_token(token) is None
    assert CREDENTIALS.decode_cookie(cookie[:-2] + "xx") is None


@pytest.mark.parametrize(
    "payload",
    [
        b"[1]",
        b'{"sid": 1, "inc": "n"}',
        b'{"sid": "a"}',
        b'{"sid": "a", "inc": "n", "tools": "step"}',
        b"not json",
    ],
)
def test_malformed_token_payloads_are_no_tokens(payload):
    assert CREDENTIALS.read_token(CREDENTIALS._token_cipher.encrypt(payload).decode()) is None


def test_session_key_digests_bind_the_id_and_the_secret():
    key = "k" * 32
    digest = CREDENTIALS.session_key_digest("a", key)
    assert digest == CREDENTIALS.session_key_digest("a", key)
    assert digest != CREDENTIALS.session_key_digest("b", key)
    assert digest != CREDENTIALS.session_key_digest("a", key + "x")
    assert digest != OTHER.session_key_digest("a", key)
    assert key.encode() not in digest
