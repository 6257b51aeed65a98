"""Property tests (no servers): session-id extraction and the space codec never fail oddly.

Session ids: `read_credentials` and `find_session_id`, fed random headers,
cookies, tokens and bodies, either name a valid id that came from one of the
request's sources, name none, or raise `InvalidSessionIdError` /
`SessionConflictError`, and nothing else. Spaces: `value_from_json` and
`space_from_json` on random JSON return a value / a space or raise
`SpaceCodecError`, and nothing else.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from typing import Any

import numpy as np
import pytest
from gymnasium.spaces import (
    Box,
    Dict,
    Discrete,
    Graph,
    MultiBinary,
    MultiDiscrete,
    OneOf,
    Sequence,
    Space,
    Text,
    Tuple,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from gym_sessions.credentials import SessionCredentials, SessionToken
from gym_sessions.errors import ForbiddenError, InvalidSessionIdError, SessionConflictError
from gym_sessions.routing.session_ids import (
    AGENT_SOURCES,
    RESOURCES_SOURCES,
    SESSION_TOKEN_HEADER,
    FoundSessionId,
    IdSource,
    SessionIdSources,
    find_session_id,
    is_valid_session_id,
    read_credentials,
)
from gym_sessions.spaces import SpaceCodecError, space_from_json, space_to_json, value_from_json

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- JSON values

# Integers a JSON peer may send: small ones, 64-bit edges and far beyond (10**400).
_EXTREME_INTS = (2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**400, -(10**400))
json_ints = st.one_of(
    st.integers(-5, 40),
    st.integers(0, len(_EXTREME_INTS) - 1).map(_EXTREME_INTS.__getitem__),
)
json_floats = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324, -0.0, 0.5, 1.0]),
)
json_strings = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["inf", "-inf", "nan", "", "../../x", "a\x00b", "é", "int64", "float32"]),
)
json_scalars = st.one_of(st.none(), st.booleans(), json_ints, json_floats, json_strings)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(json_strings, inner, max_size=4),
    ),
    max_leaves=16,
)

# ----------------------------------------------------------------------------- session ids

SECRET = "fuzz-secret-" + "k" * 20
CREDENTIALS = SessionCredentials(SECRET, "gym_session")
OTHER_KEY = SessionCredentials("another-secret-" + "z" * 20, "gym_session")

valid_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}\Z")
odd_ids = st.one_of(
    st.text(max_size=20),
    st.sampled_from(["", "../x", "../../etc/passwd", "a/b", ".", "..", "a\x00b", "é", "x" * 129]),
)
maybe_ids = st.one_of(valid_ids, odd_ids, json_values)
all_paths = st.sampled_from(
    [
        "/reset",
        "/seed_session",
        "/close_session",
        "/step",
        "/mcp",
        "/health",
        "/v1/agent_sessions",
        "/v1/agent_sessions/close",
        "/remember",
        "/run",
        "",
        "/rollouts/x/reset",
    ]
)
source_tables = st.sampled_from([RESOURCES_SOURCES, AGENT_SOURCES])


def _id_dict(key: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(
        st.fixed_dictionaries({key: maybe_ids}, optional={"other": json_values}),
        st.dictionaries(json_strings, json_values, max_size=3),
    )


@st.composite
def cookie_values(draw: st.DrawFn) -> str:
    """A cookie value: genuine, re-signed with another key, spliced, truncated or junk."""
    data = draw(st.one_of(_id_dict("session_id"), _id_dict("agent_session_id")))
    genuine = CREDENTIALS.encode_cookie(data)
    kind = draw(st.sampled_from(["genuine", "other_key", "truncated", "spliced", "junk", "token"]))
    if kind == "genuine":
        return genuine
    if kind == "other_key":
        return OTHER_KEY.encode_cookie(data)
    if kind == "truncated":
        return genuine[: draw(st.integers(0, max(0, len(genuine) - 1)))]
    if kind == "spliced":  # another payload under this signature
        payload = CREDENTIALS.encode_cookie({"session_id": "victim"}).split(".", 1)[0]
        return payload + "." + genuine.split(".", 1)[1]
    if kind == "token":  # a token is no cookie
        return CREDENTIALS.mint_token(draw(valid_ids), "n")
    return draw(st.text(max_size=60))


@st.composite
def token_values(draw: st.DrawFn) -> str:
    sid = draw(maybe_ids)
    kind = draw(st.sampled_from(["genuine", "other_key", "truncated", "junk", "cookie"]))
    payload = json.dumps({"sid": sid, "inc": "n"}).encode()
    if kind == "genuine":
        return CREDENTIALS._token_cipher.encrypt(payload).decode()
    if kind == "other_key":
        return OTHER_KEY._token_cipher.encrypt(payload).decode()
    if kind == "truncated":
        token = CREDENTIALS.mint_token("x" if not isinstance(sid, str) else sid, "n")
        return token[: draw(st.integers(0, max(0, len(token) - 1)))]
    if kind == "cookie":
        return CREDENTIALS.encode_cookie({"session_id": sid})
    return draw(st.text(max_size=60))


def _latin1(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass").decode("latin-1").encode("latin-1")


@st.composite
def header_lists(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    """ASGI headers: cookie headers (several parts, duplicates), tokens, noise."""
    headers: list[tuple[bytes, bytes]] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["cookie", "token", "noise", "raw"]))
        if kind == "cookie":
            parts = [
                f"{draw(st.sampled_from(['gym_session', 'other', 'gym_session ', '']))}="
                f"{draw(cookie_values())}"
                for _ in range(draw(st.integers(1, 3)))
            ]
            sep = draw(st.sampled_from(["; ", ";", " ; "]))
            headers.append((b"cookie", _latin1(sep.join(parts))))
        elif kind == "token":
            headers.append((SESSION_TOKEN_HEADER.encode(), _latin1(draw(token_values()))))
        elif kind == "noise":
            headers.append((b"x-noise", _latin1(draw(st.text(max_size=20)))))
        else:
            headers.append(
                (
                    draw(st.sampled_from([b"cookie", SESSION_TOKEN_HEADER.encode()])),
                    draw(st.binary(max_size=80)),
                )
            )
    return headers


@st.composite
def bodies(draw: st.DrawFn) -> Any:
    return draw(
        st.one_of(
            st.none(),
            json_values,
            st.fixed_dictionaries(
                {draw(st.sampled_from(["resources_session_id", "agent_session_id"])): maybe_ids},
                optional={"seed": json_values, "options": json_values},
            ),
        )
    )


def _check_found(
    found: FoundSessionId | None,
    sources: SessionIdSources,
    path: str,
    cookie: dict[str, Any] | None,
    token: SessionToken | None,
    body: Any,
) -> None:
    """``found`` is None or a valid id taken from the source it names, in the documented order."""
    cookie_sid = cookie.get(sources.cookie_key) if cookie else None
    token_sid = token.session_id if token else None
    token_ok = path in sources.token_paths and is_valid_session_id(token_sid)
    body_sid = (
        body.get(sources.body_key)
        if path in sources.typed_paths and isinstance(body, dict)
        else None
    )
    if found is None:
        assert not is_valid_session_id(cookie_sid)
        assert not token_ok
        assert body_sid is None
        return
    assert isinstance(found, FoundSessionId)
    assert is_valid_session_id(found.session_id)
    expected = {
        IdSource.COOKIE: cookie_sid,
        IdSource.TOKEN: token_sid,
        IdSource.BODY: body_sid,
    }
    assert found.source in expected, found
    assert found.session_id == expected[found.source]
    # Precedence: a valid cookie id wins; then a token; the body only when neither names one.
    if is_valid_session_id(cookie_sid):
        assert found.source is IdSource.COOKIE
    elif token_ok:
        assert found.source is IdSource.TOKEN
    else:
        assert found.source is IdSource.BODY


def _find_checked(
    sources: SessionIdSources,
    path: str,
    cookie: dict[str, Any] | None,
    token: SessionToken | None,
    body: Any,
) -> None:
    token_sid = token.session_id if token else None
    cookie_sid = cookie.get(sources.cookie_key) if cookie else None
    try:
        found = find_session_id(sources, path, cookie, token, body)
    except ForbiddenError:
        # A token reaches MCP tool calls only: elsewhere, without a cookie, it is refused.
        assert token is not None and path not in sources.token_paths
        assert not is_valid_session_id(cookie_sid)
        return
    except InvalidSessionIdError:
        # Only a present, malformed body id of a typed path is refused this way.
        assert path in sources.typed_paths and isinstance(body, dict)
        body_sid = body.get(sources.body_key)
        assert body_sid is not None and not is_valid_session_id(body_sid)
        return
    except SessionConflictError:
        assert path in sources.typed_paths and isinstance(body, dict)
        body_sid = body[sources.body_key]
        assert is_valid_session_id(body_sid)
        named = (
            cookie_sid
            if is_valid_session_id(cookie_sid)
            else (token_sid if path in sources.token_paths else None)
        )
        assert is_valid_session_id(named) and named != body_sid
        return
    _check_found(found, sources, path, cookie, token, body)


@FUZZ
@given(sources=source_tables, path=all_paths, headers=header_lists(), body=bodies())
@example(
    sources=RESOURCES_SOURCES,
    path="/reset",
    headers=[
        (b"cookie", b"gym_session=" + CREDENTIALS.encode_cookie({"session_id": "a"}).encode())
    ],
    body={"resources_session_id": "b"},
)
@example(
    sources=RESOURCES_SOURCES,
    path="/close_session",
    headers=[],
    body={"resources_session_id": "../../x"},
)
def test_read_credentials_then_find_session_id(sources, path, headers, body):
    cookie, token = read_credentials(headers, CREDENTIALS)
    assert cookie is None or isinstance(cookie, dict)
    assert token is None or isinstance(token.session_id, str)
    _find_checked(sources, path, cookie, token, body)


@FUZZ
@given(
    sources=source_tables,
    path=all_paths,
    cookie=st.one_of(st.none(), _id_dict("session_id"), _id_dict("agent_session_id")),
    token=st.one_of(
        st.none(), st.builds(SessionToken, st.one_of(valid_ids, odd_ids), st.just("n"))
    ),
    body=bodies(),
)
def test_find_session_id_on_decoded_sources(sources, path, cookie, token, body):
    _find_checked(sources, path, cookie, token, body)


@FUZZ
@given(data=st.one_of(_id_dict("session_id"), _id_dict("agent_session_id")), junk=st.text())
def test_only_genuine_cookies_and_tokens_are_read(data, junk):
    genuine = CREDENTIALS.encode_cookie(data)
    # A genuine cookie is read back exactly (whichever other cookies come first).
    headers = [(b"cookie", _latin1(f"a={junk[:5]}; gym_session={genuine}"))]
    assert read_credentials(headers, CREDENTIALS) == (json.loads(json.dumps(data)), None)
    # Signed with another key, spliced onto another payload, or truncated: treated as absent.
    victim = CREDENTIALS.encode_cookie({"session_id": "victim"}).split(".", 1)[0]
    forged = [OTHER_KEY.encode_cookie(data), genuine[:-1]]
    if victim != genuine.split(".", 1)[0]:
        forged.append(victim + "." + genuine.split(".", 1)[1])
    for value in forged:
        headers = [(b"cookie", _latin1(f"gym_session={value}"))]
        assert read_credentials(headers, CREDENTIALS) == (None, None), value
    sid = data.get("session_id")
    if isinstance(sid, str):
        token = CREDENTIALS.mint_token(sid, "n")
        assert read_credentials([(b"x-gym-session-token", token.encode())], CREDENTIALS) == (
            None,
            SessionToken(sid, "n"),
        )
        foreign = OTHER_KEY.mint_token(sid, "n")
        assert read_credentials([(b"x-gym-session-token", foreign.encode())], CREDENTIALS) == (
            None,
            None,
        )


# ----------------------------------------------------------------------------- space codec

SPACES: list[Space[Any]] = [
    Discrete(21, start=-10),
    Box(-1.0, 1.0, shape=(2,), dtype=np.float32),
    Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, shape=(), dtype=np.int64),
    Box(0, 255, shape=(2, 2), dtype=np.uint8),
    Box(0, 1, shape=(3,), dtype=np.bool_),
    MultiDiscrete([3, 4], start=[-1, 0]),
    MultiBinary(3),
    Text(5, charset="abc"),
    Tuple((Discrete(3), Box(-np.inf, np.inf, shape=(1,), dtype=np.float64))),
    Dict({"a": Discrete(2), "b": Text(3)}),
    Sequence(Discrete(4)),
    Sequence(Box(0, 1, shape=(2,), dtype=np.float32), stack=True),
    OneOf((Discrete(2), Box(0, 1, shape=(1,), dtype=np.float16))),
    Graph(node_space=Box(0, 1, shape=(2,), dtype=np.float32), edge_space=Discrete(3)),
]


def _space_id(space: Space[Any]) -> str:
    return type(space).__name__ + "-" + str(SPACES.index(space))


@pytest.mark.parametrize("space", SPACES, ids=_space_id)
@settings(FUZZ, max_examples=100)
@given(data=json_values)
@example(data=10**400)
@example(data=1e308)
@example(data=[[1, 2], [3]])
@example(data={"nodes": [[0.5, 0.5]], "edges": [1], "edge_links": [[0, 0]]})
@example(data=[1, [0.5]])
def test_value_from_json_raises_only_codec_errors(space, data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(SpaceCodecError):
            value_from_json(space, data)


_DTYPES = ["int64", "float32", "uint8", "bool", "float16", ">f4", "complex64", "object", "U3"]
_small = st.integers(-1, 6)
_counts = st.one_of(_small, json_ints, json_values)
_dtypes = st.one_of(st.sampled_from(_DTYPES), json_values)
_shapes = st.one_of(st.lists(_small, max_size=3), json_values)
_bound_leaf = st.one_of(
    st.integers(-3, 3),
    json_ints,
    json_floats,
    st.booleans(),
    st.sampled_from(["inf", "-inf", "nan"]),
)
_bounds = st.one_of(
    _bound_leaf,
    st.lists(_bound_leaf, max_size=3),
    st.lists(st.lists(_bound_leaf, max_size=2), max_size=2),
    json_values,
)
_int_arrays = st.one_of(
    st.lists(st.integers(-2, 5), max_size=3),
    st.lists(st.lists(st.integers(-2, 5), max_size=2), max_size=2),
    json_values,
)


def _descriptions(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Space descriptions with the right keys and random (mostly plausible) values."""
    fields: dict[str, dict[str, st.SearchStrategy[Any]]] = {
        "Box": {"dtype": _dtypes, "shape": _shapes, "low": _bounds, "high": _bounds},
        "Discrete": {"n": _counts, "start": _counts, "dtype": _dtypes},
        "MultiDiscrete": {
            "dtype": _dtypes,
            "shape": _shapes,
            "nvec": _int_arrays,
            "start": _int_arrays,
        },
        "MultiBinary": {"n": st.one_of(_counts, st.lists(_small, max_size=3))},
        "Text": {"min_length": _counts, "max_length": _counts, "charset": json_strings},
        "Tuple": {"spaces": st.lists(children, max_size=3)},
        "OneOf": {"spaces": st.lists(children, max_size=3)},
        "Dict": {
            "spaces": st.lists(
                st.one_of(st.tuples(json_strings, children).map(list), json_values), max_size=3
            )
        },
        "Sequence": {"feature_space": children, "stack": st.one_of(st.booleans(), json_values)},
        "Graph": {"node_space": children, "edge_space": st.one_of(st.none(), children)},
    }
    optional = {"Box": {"bounded_below": _bounds, "bounded_above": _bounds}}
    described = [
        st.fixed_dictionaries({"type": st.just(kind), **required}, optional=optional.get(kind, {}))
        for kind, required in fields.items()
    ]
    # Now and then a key too many or too few, or no description at all.
    mangled = st.builds(
        lambda d, extra, drop: {
            **{k: v for k, v in d.items() if k != drop},
            **extra,
        },
        st.one_of(described),
        st.dictionaries(st.sampled_from(["n", "spaces", "stack", "junk"]), json_values, max_size=1),
        st.sampled_from(["type", "n", "spaces", "dtype", "none"]),
    )
    return st.one_of(*described, mangled, json_values)


space_descriptions = st.recursive(_descriptions(json_scalars), _descriptions, max_leaves=6)


@FUZZ
@given(data=space_descriptions)
@example(data={"type": "Box", "dtype": "float32", "shape": [2**40], "low": 0, "high": 1})
@example(data={"type": "Discrete", "n": 10**400, "start": 0, "dtype": "int64"})
@example(data={"type": "MultiBinary", "n": [2**62, 2**62]})
@example(data={"type": "Text", "min_length": 0, "max_length": 3, "charset": ""})
def test_space_from_json_raises_only_codec_errors(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            space = space_from_json(data)
        except SpaceCodecError:
            return
    assert isinstance(space, Space)
    # A description the decoder accepted describes a space the encoder can write.
    space_to_json(space)
