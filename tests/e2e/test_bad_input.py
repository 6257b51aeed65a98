"""Bad input against every public route, with real servers at 1 and at 4 workers.

Each case sends one malformed request (non-JSON, wrong types, missing or unknown
fields, actions outside the space, huge numbers, NaN/Infinity, bad cookies and
tokens, odd session ids, unknown routes and methods) and checks the exact
status and error code of docs/design.md §3.7 (for MCP: the JSON-RPC error), that a
session the request names is unharmed, and that a healthy episode run alongside
it on the same server still scores 1.0. Per server the last test checks that
no worker died: the set of worker ids answering ``/health`` is unchanged.

Cases marked ``bug`` are product bugs, kept as strict xfails so they stay recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest
from yarl import URL

from envs.counter_load import Episode, play
from gym_sessions.credentials import SessionCredentials
from gym_sessions.server.process import ServerProcess, start_server

pytestmark = pytest.mark.e2e

SECRET = "bad-input-secret-" + "s" * 24
CREDENTIALS = SessionCredentials(SECRET, "gym_session")
OTHER_KEY = SessionCredentials("some-other-secret-" + "o" * 24, "gym_session")
TOKEN = "X-Gym-Session-Token"
ENV, AGENT, REPL = (
    "envs.counter:CounterEnv",
    "envs.counter_agent:CounterAgent",
    "envs.python_repl:PythonReplServer",
)


# The REPL server runs each interpreter under a uid of its own as root; as
# another user it starts only unsandboxed (bad input never reaches the sandbox).
REPL_ARGS = () if os.geteuid() == 0 else ("--unsandboxed",)
ROLLOUT = "/rollouts/r-7"
BIG_INT = "1" + "0" * 400  # 10**400 as a JSON integer literal
MIB = 1 << 20
BAD = "400 invalid_request"


# ----------------------------------------------------------------------------- servers


@dataclass
class Stack:
    """The servers of one worker count, and their worker ids when they started."""

    workers: int
    servers: dict[str, ServerProcess]
    worker_ids: dict[str, set[str]] = field(default_factory=dict)


def _probe_worker_ids(url: str, expected: int, tries: int = 200) -> set[str]:
    """Worker ids seen by ``/health`` on new connections: at least 40 probes, then
    until ``expected`` ids are seen (uvicorn hands connections out unevenly)."""
    seen: set[str] = set()
    for probe in range(tries):
        with urllib.request.urlopen(url + "/health", timeout=10) as reply:
            seen.add(json.loads(reply.read())["worker"])
        if probe >= 40 and len(seen) >= expected:
            break
    return seen


# At 4 workers a case meets both a local and a forwarded request path; the
# 1-worker stack adds no path of its own, so only the full run has it.
@pytest.fixture(
    scope="module",
    params=[pytest.param(1, id="1worker", marks=pytest.mark.slow), pytest.param(4, id="4workers")],
)
def stack(request) -> Iterator[Stack]:
    workers = request.param
    tmp = tempfile.mkdtemp(prefix="gs-", dir="/tmp")
    started: dict[str, ServerProcess] = {}

    def start(kind: str, target: str, *args: str) -> ServerProcess:
        return start_server(
            target, *args, workers=workers, secret=SECRET, tmpdir=os.path.join(tmp, kind)
        )

    try:
        # The agent may call the env server only (--allow-env): it starts once that listens.
        with ThreadPoolExecutor(2) as pool:
            futures = {
                "env": pool.submit(start, "env", ENV),
                "repl": pool.submit(start, "repl", REPL, *REPL_ARGS),
            }
            failures = []
            for kind, future in futures.items():
                try:
                    started[kind] = future.result()
                except Exception as exc:  # stop the others in the finally
                    failures.append(exc)
            if failures:
                raise failures[0]
        started["agent"] = start("agent", AGENT, "--allow-env", started["env"].url)
        result = Stack(workers, started)
        for kind, server in started.items():
            result.worker_ids[kind] = _probe_worker_ids(server.url, workers)
            assert len(result.worker_ids[kind]) == workers, (kind, result.worker_ids[kind])
        yield result
    finally:
        for server in started.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- requests


@dataclass
class Reply:
    status: int
    headers: Any
    raw: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.raw)


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """New connection per request, so requests land on any worker; no cookie jar."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True, limit=64),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=60),
        auto_decompress=False,
    ) as session:
        yield session


async def send(
    client: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    async with client.request(
        method, URL(url, encoded=True), data=body, headers=headers or {}, allow_redirects=False
    ) as reply:
        return Reply(reply.status, reply.headers, await reply.read())


def _cookie_of(reply: Reply) -> str | None:
    for value in reply.headers.getall("set-cookie", []):
        name, _, rest = value.partition("=")
        if name == "gym_session":
            return rest.split(";", 1)[0]
    return None


def dump(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def rpc(method: str, params: Any = None, request_id: Any = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return dump(message)


def call(name: Any, arguments: Any = None) -> bytes:
    params: dict[str, Any] = {"name": name}
    if arguments is not None:
        params["arguments"] = arguments
    return rpc("tools/call", params)


# ----------------------------------------------------------------------------- sessions


@dataclass
class Session:
    sid: str
    cookie: str
    token: str | None


async def open_session(
    client: aiohttp.ClientSession, kind: str, url: str, extra: dict[str, Any] | None = None
) -> Session:
    sid = "s-" + uuid.uuid4().hex
    if kind == "agent":
        reply = await send(
            client,
            "POST",
            url + "/v1/agent_sessions",
            dump({"agent_session_id": sid, **(extra or {})}),
        )
        assert reply.status == 200, reply.raw
        cookie = _cookie_of(reply)
        assert cookie
        return Session(sid, cookie, None)
    body: dict[str, Any] = {"resources_session_id": sid, **(extra or {})}
    if kind == "env":
        body["options"] = {"initial_count": 7}
    reply = await send(client, "POST", url + "/seed_session", dump(body))
    assert reply.status == 200, reply.raw
    cookie = _cookie_of(reply)
    assert cookie
    return Session(sid, cookie, reply.json["mcp"]["headers"][TOKEN])


async def assert_unharmed(client: aiohttp.ClientSession, kind: str, url: str, s: Session) -> None:
    """The session still holds exactly the state it was opened with."""
    headers = {"Cookie": f"gym_session={s.cookie}"}
    if kind == "env":
        reply = await send(client, "POST", url + "/observe", b"{}", headers)
        assert (reply.status, reply.json) == (200, {"observation": 7, "episode_length": 0})
    elif kind == "agent":
        reply = await send(client, "POST", url + "/remember", b'{"value": 0}', headers)
        assert (reply.status, reply.json) == (200, {"count": 1, "total": 0})
    else:
        code = dump({"code": "print(1 + 1)"})
        reply = await send(client, "POST", url + "/run_code", code, headers)
        assert reply.status == 200 and reply.json["stdout"] == "2\n", reply.raw


async def healthy_episode(client: aiohttp.ClientSession, stack: Stack, kind: str) -> None:
    """One good episode on the server under test; it must score 1.0."""
    url = stack.servers[kind].url
    if kind == "env":
        episode = await play(client, url, Episode(uuid.uuid4().hex, 5, [3, -2, 10, -1]))
        assert episode.reward == 1.0 and set(episode.statuses) == {200}, episode
    elif kind == "agent":
        task = {"initial_count": -4, "increments": [2, 9, -3], "expected_count": 4}
        body = {"env_url": stack.servers["env"].url, "task": task}
        reply = await send(client, "POST", url + "/run", dump(body))
        assert reply.status == 200 and reply.json["reward"] == 1.0, reply.raw
    else:
        sid = "h-" + uuid.uuid4().hex
        start = {"resources_session_id": sid, "expected_stdout": "42\n"}
        reply = await send(client, "POST", url + "/seed_session", dump(start))
        assert reply.status == 200, reply.raw
        headers = {"Cookie": f"gym_session={_cookie_of(reply)}"}
        for code in ("x = 41", "print(x + 1)"):
            reply = await send(client, "POST", url + "/run_code", dump({"code": code}), headers)
            assert reply.status == 200 and reply.json["error"] is None, reply.raw
        reply = await send(
            client, "POST", url + "/verify", b"{}", {**headers, "x-gym-close-follows": "1"}
        )
        assert reply.status == 200 and reply.json["reward"] == 1.0, reply.raw
        # The close carries the cookie: an id alone reaches no session it did not start.
        reply = await send(
            client, "POST", url + "/close_session", dump({"resources_session_id": sid}), headers
        )
        assert reply.status == 200 and reply.json["outcome"] == "closed"


# ----------------------------------------------------------------------------- cases


@dataclass
class Ctx:
    own: Session | None = None
    other: Session | None = None


Body = bytes | Callable[[Ctx], bytes] | None


def _forged_cookie(kind: str, ctx: Ctx) -> str:
    """A cookie value of the given ``kind`` (tampered, re-signed, odd ids, ...)."""
    own = ctx.own
    if kind == "tampered":
        assert own
        return own.cookie[:-4] + ("AAAA" if not own.cookie.endswith("AAAA") else "BBBB")
    if kind == "truncated":
        assert own
        return own.cookie[: len(own.cookie) // 2]
    if kind == "other-key":
        assert own
        return OTHER_KEY.encode_cookie({"session_id": own.sid, "agent_session_id": own.sid})
    if kind == "spliced":  # the other session's payload under this session's signature
        assert own and ctx.other
        return ctx.other.cookie.split(".", 1)[0] + "." + own.cookie.split(".", 1)[1]
    if kind == "token":
        assert own and own.token
        return own.token
    if kind == "garbage":
        return "not-a-cookie!@#"
    if kind == "huge":
        return "A" * 60_000  # under max_header_bytes: junk, treated as absent
    odd_ids: dict[str, Any] = {
        "path-id": "../../x",
        "nul-id": "a\x00b",
        "long-id": "a" * 10_000,
        "unicode-id": "sess-é-☃",
        "int-id": 12345,
        "empty-id": "",
    }
    if kind in odd_ids:
        sid = odd_ids[kind]
        return CREDENTIALS.encode_cookie({"session_id": sid, "agent_session_id": sid})
    if kind == "list-payload":
        return CREDENTIALS.encode_cookie([1, 2])  # type: ignore[arg-type]
    raise AssertionError(kind)


def _forged_token(kind: str, ctx: Ctx) -> str:
    own = ctx.own
    if kind == "garbage":
        return "not-a-token"
    if kind == "truncated":
        assert own and own.token
        return own.token[: len(own.token) - 3]
    if kind == "other-key":  # the session's own token, minted with another key
        assert own
        token = CREDENTIALS.read_token(own.token)
        assert token is not None
        return OTHER_KEY.mint_token(own.sid, token.incarnation)
    if kind == "cookie":  # a cookie is no token
        assert own
        return own.cookie
    if kind == "path-id":  # correctly signed, but naming no valid session
        return CREDENTIALS.mint_token("../../x", "any-incarnation")
    if kind == "huge":
        return "T" * 60_000  # under max_header_bytes: junk, treated as absent
    raise AssertionError(kind)


@dataclass(frozen=True)
class Case:
    """One bad request and the replies it may get.

    Attributes:
        expect: Allowed replies as ``(status, code)``: ``code`` is a framework
            error code, a JSON-RPC error code (int), or ``None`` for no error.
        cookie: ``own`` / ``other`` (a fresh session's cookie) or a forged kind.
        token: ``own`` / ``other`` (a fresh session's token) or a forged kind.
        seed: Extra fields of the fresh session's start (agent sessions).
        rpc_data: For JSON-RPC -32001 errors: the framework code in ``data``.
        tool_error: The reply is a tool result with ``isError`` and this code.
        check: Extra check of a successful reply's JSON.
        bug: A product bug: the case is a strict xfail with this reason.
    """

    name: str
    kind: str
    method: str
    path: str
    body: Body
    expect: tuple[tuple[int, str | int | None], ...]
    cookie: str | None = None
    token: str | None = None
    headers: tuple[tuple[str, str], ...] = ()
    seed: tuple[tuple[str, Any], ...] = ()
    rpc_data: str | None = None
    tool_error: str | None = None
    check: Callable[[Any, Ctx], None] | None = None
    bug: str | None = None
    rollout: bool = False

    @property
    def sessions(self) -> int:
        """How many fresh sessions the case needs (its own, and another one)."""
        if "other" in (self.cookie, self.token) or self.cookie == "spliced" or callable(self.body):
            return 2
        uses_own = {"own", "tampered", "truncated", "other-key", "token", "cookie"}
        return 1 if {self.cookie, self.token} & uses_own or self.seed else 0


def _parse_expect(text: str) -> tuple[tuple[tuple[int, str | int | None], ...], dict[str, Any]]:
    """``"404 no_open_episode"``, ``"200"``, ``"400 -32700"``, ``"401 -32001 invalid_token"``,
    ``"200 isError invalid_request"``; alternatives joined by `` or ``."""
    options: list[tuple[int, str | int | None]] = []
    extra: dict[str, Any] = {}
    for option in text.split(" or "):
        status, *rest = option.split()
        code: str | int | None = None
        if rest and rest[0] == "isError":
            extra["tool_error"] = rest[1]
        elif rest:
            code = int(rest[0]) if rest[0].lstrip("-").isdigit() else rest[0]
            if len(rest) > 1:
                extra["rpc_data"] = rest[1]
        options.append((int(status), code))
    return tuple(options), extra


def _case(kind: str, name: str, route: str, body: Body, expect: str, **kw: Any) -> Case:
    method, path = route.split(" ", 1)
    options, extra = _parse_expect(expect)
    return Case(name, kind, method, path, body, options, **extra, **kw)


def E(name: str, route: str, body: Body = None, expect: str = BAD, **kw: Any) -> Case:
    return _case("env", name, route, body, expect, **kw)


def A(name: str, route: str, body: Body = None, expect: str = BAD, **kw: Any) -> Case:
    return _case("agent", name, route, body, expect, **kw)


def R(name: str, route: str, body: Body = None, expect: str = BAD, **kw: Any) -> Case:
    return _case("repl", name, route, body, expect, **kw)


def _new_session_named(payload: Any, ctx: Ctx) -> None:
    """A session start that ignored a bad cookie: a new minted id, not the cookie's."""
    sid = payload["resources_session_id"]
    assert len(sid) == 32 and all(ch in "0123456789abcdef" for ch in sid), sid
    assert ctx.own is None or sid != ctx.own.sid


def _named(expected: str) -> Callable[[Any, Ctx], None]:
    def check(payload: Any, ctx: Ctx) -> None:
        assert payload["resources_session_id"] == expected

    return check


def _own_state(payload: Any, ctx: Ctx) -> None:
    # The cookie named this session: its count (7) moved by the step, never the other's.
    assert payload["observation"] == 7 + 1


def _other_id(key: str) -> Callable[[Ctx], bytes]:
    def body(ctx: Ctx) -> bytes:
        assert ctx.other
        return dump({key: ctx.other.sid})

    return body


def _j(template: str) -> bytes:
    """A JSON body with ``BIG`` standing for 10**400 as an integer literal."""
    return template.replace("BIG", BIG_INT).encode()


ODD_BODY_IDS = {
    "dotdot": "../../etc/passwd",
    "slash": "a/b",
    "dot": ".",
    "nul": "a\x00b",
    "10kb": "a" * 10_000,
    "129": "a" * 129,
    "unicode": "sess-é",
    "empty": "",
    "space": "a b",
    "int": 5,
    "list": ["a"],
}
FORGED_COOKIES = (
    "tampered",
    "truncated",
    "other-key",
    "spliced",
    "token",
    "garbage",
    "huge",
    "path-id",
    "nul-id",
    "long-id",
    "unicode-id",
    "int-id",
    "empty-id",
    "list-payload",
)
STEP_1 = call("step", {"action": 1})
NOT_FOUND, NO_EPISODE, CONFLICT = "404 not_found", "404 no_open_episode", "409 session_conflict"
NOT_ALLOWED, BAD_JSON, OK = "405 method_not_allowed", "400 invalid_json", "200"
FORBIDDEN = "403 forbidden"

# fmt: off
ENV_CASES: list[Case] = [
    # /step: body shape and JSON.
    E("step-not-json", "POST /step", b"{not json", BAD_JSON),
    E("step-invalid-utf8", "POST /step", b"\x80\x81{", BAD_JSON),
    E("step-truncated-json", "POST /step", b'{"action": 1', BAD_JSON),
    E("step-deep-nesting", "POST /step", b"[" * 100_000 + b"]" * 100_000, BAD_JSON),
    E("step-nan", "POST /step", b'{"action": NaN}', BAD_JSON, cookie="own"),
    E("step-infinity", "POST /step", b'{"action": Infinity}', BAD_JSON, cookie="own"),
    E("step-neg-infinity", "POST /step", b'{"action": -Infinity}', BAD_JSON),
    E("step-empty-body", "POST /step", b"", cookie="own"),
    E("step-null-body", "POST /step", b"null", cookie="own"),
    E("step-list-body", "POST /step", b"[1, 2]", cookie="own"),
    E("step-string-body", "POST /step", b'"action"', cookie="own"),
    E("step-number-body", "POST /step", b"3", cookie="own"),
    E("step-missing-action", "POST /step", b"{}", cookie="own"),
    E("step-unknown-field", "POST /step", b'{"action": 1, "extra": 2}', cookie="own"),
    # /step: actions outside the space [-10, 10].
    *[
        E(f"action-{label}", "POST /step", _j('{"action": ' + value + "}"), cookie="own")
        for label, value in [
            ("11", "11"), ("minus-11", "-11"), ("float", "1.5"), ("integral-float", "1.0"),
            ("bool", "true"), ("string", '"1"'), ("list", "[1]"), ("object", "{}"),
            ("null", "null"), ("1e308", "1e308"), ("minus-1e308", "-1e308"),
            ("1e-400", "1e-400"), ("1e400-float", "1e400"), ("10e400-int", "BIG"),
            ("minus-10e400-int", "-BIG"),
        ]
    ],
    E("step-without-session", "POST /step", b'{"action": 1}', NO_EPISODE),
    # Bad cookies and tokens are treated as none: no open episode.
    *[
        E(f"step-cookie-{kind}", "POST /step", b'{"action": 1}', NO_EPISODE, cookie=kind)
        for kind in FORGED_COOKIES
    ],
    *[
        E(f"step-token-{kind}", "POST /step", b'{"action": 1}', NO_EPISODE, token=kind)
        for kind in ("garbage", "truncated", "other-key", "cookie", "huge")
    ],
    # A correctly signed token is one, and a token reaches only MCP tool calls.
    E("step-token-path-id", "POST /step", b'{"action": 1}', FORBIDDEN, token="path-id"),
    # The cookie names the session; another session's token beside it changes nothing.
    E("step-own-cookie-other-token", "POST /step", b'{"action": 1}', OK, cookie="own",
      token="other", check=_own_state),
    # /observe
    E("observe-unknown-field", "POST /observe", b'{"x": 1}', cookie="own"),
    E("observe-huge-unknown-field", "POST /observe", _j('{"x": BIG}'), cookie="own"),
    E("observe-list", "POST /observe", b"[]", cookie="own"),
    E("observe-not-json", "POST /observe", b"{", BAD_JSON, cookie="own"),
    E("observe-nan", "POST /observe", b'{"x": NaN}', BAD_JSON, cookie="own"),
    E("observe-without-session", "POST /observe", b"{}", NO_EPISODE),
    # /reset and /seed_session
    *[
        case
        for route in ("POST /reset", "POST /seed_session")
        for r in [route.split("/", 1)[1]]
        for case in (
            E(f"{r}-not-json", route, b"{oops", BAD_JSON),
            E(f"{r}-nan", route, b'{"seed": NaN}', BAD_JSON),
            E(f"{r}-infinity", route, b'{"options": {"a": Infinity}}', BAD_JSON),
            E(f"{r}-list", route, b"[]"),
            E(f"{r}-seed-string", route, b'{"seed": "x"}'),
            E(f"{r}-seed-negative", route, b'{"seed": -1}'),
            E(f"{r}-seed-1e308", route, b'{"seed": 1e308}'),
            E(f"{r}-seed-10e400", route, _j('{"seed": BIG}')),
            E(f"{r}-seed-2-64", route, b'{"seed": 18446744073709551616}'),
            E(f"{r}-options-number", route, b'{"options": 3}'),
            E(f"{r}-render-mode-unknown", route, b'{"render_mode": "human"}'),
            E(f"{r}-render-mode-int", route, b'{"render_mode": 5}'),
            *[
                E(f"{r}-body-id-{label}", route, dump({"resources_session_id": sid}),
                  "400 invalid_session_id")
                for label, sid in ODD_BODY_IDS.items()
            ],
            # The env itself refuses options it cannot use: 500 env_error, the worker lives.
            E(f"{r}-options-1e308", route, b'{"options": {"initial_count": 1e308}}',
              "500 env_error"),
            E(f"{r}-options-10e400", route, _j('{"options": {"initial_count": BIG}}'),
              "500 env_error"),
            # Cookie or token and body naming different sessions.
            E(f"{r}-cookie-vs-body", route, _other_id("resources_session_id"), CONFLICT,
              cookie="own"),
            # A token reaches only MCP tool calls.
            E(f"{r}-token-vs-body", route, _other_id("resources_session_id"), FORBIDDEN,
              token="own"),
            # Forged cookies are ignored: the start names a new session, or the body's.
            E(f"{r}-forged-cookie", route, b"{}", OK, cookie="other-key",
              check=_new_session_named),
            E(f"{r}-path-id-cookie", route, b"{}", OK, cookie="path-id",
              check=_new_session_named),
            # An id per route: a second start of an open id needs its cookie or key.
            E(f"{r}-path-id-cookie-body-id", route, dump({"resources_session_id": f"good-1.{r}"}),
              OK, cookie="path-id", check=_named(f"good-1.{r}")),
        )
    ],
    # /verify
    E("verify-list", "POST /verify", b"[1]", cookie="own"),
    E("verify-string", "POST /verify", b'"x"', cookie="own"),
    E("verify-not-json", "POST /verify", b"{", BAD_JSON, cookie="own"),
    E("verify-nan", "POST /verify", b'{"x": NaN}', BAD_JSON, cookie="own"),
    E("verify-without-session", "POST /verify", b"{}", NO_EPISODE),
    E("verify-huge-numbers", "POST /verify", _j('{"a": BIG, "b": 1e308}'), OK, cookie="own",
      headers=(("x-gym-close-follows", "1"),)),
    # /close_session
    E("close-unknown-field", "POST /close_session", b'{"x": 1}', cookie="own"),
    E("close-list", "POST /close_session", b"[]", cookie="own"),
    E("close-not-json", "POST /close_session", b"{", BAD_JSON, cookie="own"),
    E("close-nan", "POST /close_session", b'{"resources_session_id": NaN}', BAD_JSON,
      cookie="own"),
    E("close-id-1e308", "POST /close_session", b'{"resources_session_id": 1e308}',
      "400 invalid_session_id", cookie="own"),
    *[
        E(f"close-body-id-{label}", "POST /close_session", dump({"resources_session_id": sid}),
          "400 invalid_session_id", cookie="own")
        for label, sid in ODD_BODY_IDS.items()
    ],
    E("close-cookie-vs-body", "POST /close_session", _other_id("resources_session_id"),
      CONFLICT, cookie="own"),
    # A close that names no session (a forged cookie names none) is refused.
    E("close-empty-body", "POST /close_session", b""),
    E("close-forged-cookie", "POST /close_session", b"{}", cookie="tampered"),
    # /aggregate_metrics
    E("aggregate-empty", "POST /aggregate_metrics", b""),
    E("aggregate-missing", "POST /aggregate_metrics", b"{}"),
    E("aggregate-object", "POST /aggregate_metrics", b'{"verify_responses": {}}'),
    E("aggregate-items", "POST /aggregate_metrics", b'{"verify_responses": [1]}'),
    E("aggregate-unknown", "POST /aggregate_metrics", b'{"verify_responses": [], "x": 1}'),
    E("aggregate-nan", "POST /aggregate_metrics", b'{"verify_responses": [{"r": NaN}]}',
      BAD_JSON),
    E("aggregate-one-1e308", "POST /aggregate_metrics",
      b'{"verify_responses": [{"reward": 1e308}]}', OK),
    E("aggregate-sum-overflows", "POST /aggregate_metrics",
      b'{"verify_responses": [{"reward": 1e308}, {"reward": 1e308}]}',
      f"{OK} or {BAD}"),
    E("aggregate-10e400", "POST /aggregate_metrics", _j('{"verify_responses": [{"r": BIG}]}'),
      f"{OK} or {BAD}"),
    # /render
    E("render-unknown-field", "POST /render", b'{"x": 1}', cookie="own"),
    E("render-without-session", "POST /render", b"{}", NO_EPISODE),
    # /spaces and /health ignore bodies and credentials.
    E("spaces-junk-body-and-cookie", "GET /spaces", b"{oops", OK, cookie="garbage"),
    E("health-forged-token", "GET /health", None, OK, token="other-key"),
    # /mcp: JSON-RPC framing (message errors come with HTTP 200, framing errors with 400).
    E("mcp-not-json", "POST /mcp", b"{oops", "400 -32700", token="own"),
    E("mcp-empty", "POST /mcp", b"", "400 -32700", token="own"),
    E("mcp-nan", "POST /mcp", STEP_1.replace(b"1}", b"NaN}"), "400 -32700", token="own"),
    E("mcp-list", "POST /mcp", b"[]", "400 -32600", token="own"),
    E("mcp-string", "POST /mcp", b'"x"', "400 -32600", token="own"),
    E("mcp-version", "POST /mcp", b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}',
      "400 -32600", token="own"),
    E("mcp-method-int", "POST /mcp", b'{"jsonrpc": "2.0", "id": 1, "method": 5}',
      "400 -32600", token="own"),
    E("mcp-unknown-method", "POST /mcp", rpc("no/such"), "200 -32601", token="own"),
    E("mcp-params-list", "POST /mcp", rpc("tools/call", [1]), "200 -32602", token="own"),
    E("mcp-unknown-tool", "POST /mcp", call("fly"), "200 -32602", token="own"),
    E("mcp-tool-name-int", "POST /mcp", call(5), "200 -32602", token="own"),
    E("mcp-tool-name-list", "POST /mcp", call(["step"]), "200 -32602", token="own"),
    E("mcp-tool-name-object", "POST /mcp", call({"n": 1}), "200 -32602", token="own"),
    E("mcp-arguments-list", "POST /mcp", call("step", [1]), "200 -32602", token="own"),
    E("mcp-arguments-false", "POST /mcp", call("observe", False), "200 -32602", token="own"),
    E("mcp-missing-action", "POST /mcp", call("step", {}), "200 -32602", token="own"),
    E("mcp-unknown-argument", "POST /mcp", call("step", {"action": 1, "x": 2}), "200 -32602",
      token="own"),
    # A tool's own failure (an action outside the space) is a result with isError.
    *[
        E(f"mcp-action-{label}", "POST /mcp",
          STEP_1.replace(b'"action": 1', b'"action": ' + value.encode()),
          "200 isError invalid_request", token="own")
        for label, value in [
            ("11", "11"), ("1e308", "1e308"), ("10e400", BIG_INT), ("string", '"1"'),
            ("float", "1.5"),
        ]
    ],
    # Tokens: missing, forged, or of another session.
    *[
        E(f"mcp-token-{kind or 'missing'}", "POST /mcp", STEP_1, "401 -32001 invalid_token",
          token=kind)
        for kind in (None, "garbage", "truncated", "other-key", "cookie", "huge")
    ],
    E("mcp-token-of-another-session", "POST /mcp", STEP_1, "401 -32001 invalid_token",
      cookie="own", token="other"),
    E("mcp-token-naming-a-path", "POST /mcp", STEP_1, "401 -32001 invalid_token",
      token="path-id"),
    # Unknown routes and methods.
    E("unknown-route", "GET /nope", None, NOT_FOUND),
    E("unknown-route-post", "POST /nope", b"{}", NOT_FOUND),
    E("route-case", "POST /STEP", b"{}", NOT_FOUND),
    E("rollouts-bare", "GET /rollouts/", None, NOT_FOUND),
    E("rollouts-empty-id", "POST /rollouts//step", b"{}", NOT_FOUND),
    E("rollouts-nested", "GET /rollouts/a/rollouts/b/health", None, NOT_FOUND),
    E("rollouts-encoded-slashes", "POST /rollouts/..%2F..%2Fetc/step", b"{}", NOT_FOUND),
    E("path-nul", "GET /health%00", None, NOT_FOUND),
    E("path-dotdot", "GET /../health", None, NOT_FOUND),
    E("rollout-id-nul", "GET /rollouts/a%00b/health", None, OK),
    E("rollout-id-unicode", "GET /rollouts/%C3%A9%E2%98%83/health", None, OK),
    E("rollout-id-10kb", "GET /rollouts/" + "r" * 10_000 + "/health", None, OK),
    E("rollout-id-dotdot", "GET /rollouts/%2e%2e/health", None, OK),
    E("get-step", "GET /step", None, NOT_ALLOWED),
    E("get-reset", "GET /reset", None, NOT_ALLOWED),
    E("put-step", "PUT /step", b"{}", NOT_ALLOWED),
    E("patch-verify", "PATCH /verify", b"{}", NOT_ALLOWED),
    E("delete-close", "DELETE /close_session", None, NOT_ALLOWED),
    E("options-observe", "OPTIONS /observe", None, NOT_ALLOWED),
    E("trace-seed", "TRACE /seed_session", None, NOT_ALLOWED),
    E("post-health", "POST /health", b"{}", NOT_ALLOWED),
    E("post-spaces", "POST /spaces", b"{}", NOT_ALLOWED),
    E("get-aggregate", "GET /aggregate_metrics", None, NOT_ALLOWED),
    E("put-mcp", "PUT /mcp", b"{}", NOT_ALLOWED),
    E("get-mcp", "GET /mcp", None, NOT_ALLOWED),
]

AGENT_CASES: list[Case] = [
    A("run-not-json", "POST /run", b"{oops", BAD_JSON),
    A("run-nan", "POST /run", b'{"env_url": "http://x", "seed": NaN}', BAD_JSON),
    A("run-empty", "POST /run", b""),
    A("run-list", "POST /run", b"[]"),
    A("run-missing-env-url", "POST /run", b'{"task": {}}'),
    A("run-env-url-int", "POST /run", b'{"env_url": 5}'),
    A("run-seed-1e308", "POST /run", b'{"env_url": "ENV", "seed": 1e308}'),
    A("run-max-steps-string", "POST /run", b'{"env_url": "ENV", "max_steps": "3"}'),
    A("run-task-number", "POST /run", b'{"env_url": "ENV", "task": 5}'),
    A("run-options-list", "POST /run", b'{"env_url": "ENV", "options": []}'),
    A("run-increments-number", "POST /run", b'{"env_url": "ENV", "task": {"increments": 5}}'),
    A("run-model-number", "POST /run", b'{"env_url": "ENV", "model": 5}'),
    # What the env server refuses ends the run with 502 naming the env server's error.
    A("run-seed-10e400", "POST /run", _j('{"env_url": "ENV", "seed": BIG}'), "502 bad_gateway"),
    A("run-increment-11", "POST /run", b'{"env_url": "ENV", "task": {"increments": [11]}}',
      "502 bad_gateway"),
    A("run-increment-10e400", "POST /run",
      _j('{"env_url": "ENV", "task": {"increments": [BIG]}}'), "502 bad_gateway"),
    # Only the env server the agent was started with (--allow-env) may be named.
    A("run-env-url-not-a-url", "POST /run", b'{"env_url": "not a url"}', "400 forbidden_target"),
    A("run-env-url-not-allowed", "POST /run", b'{"env_url": "http://127.0.0.1:1"}',
      "400 forbidden_target"),
    A("run-model-not-allowed", "POST /run",
      b'{"env_url": "ENV", "model": {"base_url": "http://127.0.0.1:1"}}', "400 forbidden_target"),
    # /v1/agent_sessions
    A("seed-not-json", "POST /v1/agent_sessions", b"{oops", BAD_JSON),
    A("seed-nan", "POST /v1/agent_sessions", b'{"agent_session_id": NaN}', BAD_JSON),
    A("seed-empty", "POST /v1/agent_sessions", b""),
    A("seed-list", "POST /v1/agent_sessions", b"[]"),
    A("seed-missing-id", "POST /v1/agent_sessions", b'{"values": []}'),
    *[
        A(f"seed-id-{label}", "POST /v1/agent_sessions", dump({"agent_session_id": sid}),
          "400 invalid_session_id")
        for label, sid in ODD_BODY_IDS.items()
    ],
    A("seed-id-1e308", "POST /v1/agent_sessions", b'{"agent_session_id": 1e308}',
      "400 invalid_session_id"),
    A("seed-cookie-vs-body", "POST /v1/agent_sessions", _other_id("agent_session_id"),
      CONFLICT, cookie="own"),
    A("seed-values-number", "POST /v1/agent_sessions",
      b'{"agent_session_id": "values-not-a-list", "values": 5}'),
    # /v1/agent_sessions/close
    A("close-missing-id", "POST /v1/agent_sessions/close", b"{}"),
    A("close-unknown-field", "POST /v1/agent_sessions/close",
      lambda c: dump({"agent_session_id": c.own.sid if c.own else "", "x": 1}), cookie="own"),
    A("close-id-path", "POST /v1/agent_sessions/close", b'{"agent_session_id": "../x"}',
      "400 invalid_session_id"),
    A("close-cookie-vs-body", "POST /v1/agent_sessions/close", _other_id("agent_session_id"),
      CONFLICT, cookie="own"),
    # /remember
    A("remember-without-session", "POST /remember", b'{"value": 1}', NOT_FOUND),
    A("remember-forged-cookie", "POST /remember", b'{"value": 1}', NOT_FOUND,
      cookie="other-key"),
    A("remember-spliced-cookie", "POST /remember", b'{"value": 1}', NOT_FOUND,
      cookie="spliced"),
    A("remember-float", "POST /remember", b'{"value": 1.5}', cookie="own"),
    A("remember-1e308", "POST /remember", b'{"value": 1e308}', cookie="own"),
    A("remember-missing", "POST /remember", b"{}", cookie="own"),
    A("remember-unknown", "POST /remember", b'{"value": 1, "x": 2}', cookie="own"),
    A("remember-nan", "POST /remember", b'{"value": NaN}', BAD_JSON, cookie="own"),
    A("seed-values-strings", "POST /v1/agent_sessions",
      b'{"agent_session_id": "values-strings", "values": ["a"]}'),
    # Routes and methods.
    A("unknown-route", "POST /step", b"{}", NOT_FOUND),
    A("no-mcp", "POST /mcp", b"{}", NOT_FOUND),
    A("get-run", "GET /run", None, NOT_ALLOWED),
    A("get-seed", "GET /v1/agent_sessions", None, NOT_ALLOWED),
    A("delete-close", "DELETE /v1/agent_sessions/close", None, NOT_ALLOWED),
    A("put-remember", "PUT /remember", b"{}", NOT_ALLOWED),
]

REPL_CASES: list[Case] = [
    R("run-code-not-json", "POST /run_code", b"{oops", BAD_JSON),
    R("run-code-empty", "POST /run_code", b""),
    R("run-code-list", "POST /run_code", b"[]"),
    R("run-code-code-int", "POST /run_code", b'{"code": 5}'),
    R("run-code-unknown", "POST /run_code", b'{"code": "1", "x": 1}'),
    R("run-code-timeout-string", "POST /run_code", b'{"code": "1", "timeout": "5"}'),
    R("run-code-timeout-bool", "POST /run_code", b'{"code": "1", "timeout": true}'),
    R("run-code-timeout-zero", "POST /run_code", b'{"code": "1", "timeout": 0}'),
    R("run-code-timeout-negative", "POST /run_code", b'{"code": "1", "timeout": -1}'),
    R("run-code-timeout-1e308", "POST /run_code", b'{"code": "1", "timeout": 1e308}'),
    R("run-code-timeout-nan", "POST /run_code", b'{"code": "1", "timeout": NaN}', BAD_JSON),
    R("run-code-timeout-10e400", "POST /run_code", _j('{"code": "1", "timeout": BIG}'),
      cookie="own"),
    R("mcp-run-code-timeout-10e400", "POST /mcp",
      call("run_code", {"code": "1", "timeout": 0}).replace(b'"timeout": 0', _j('"timeout": BIG')),
      "200 -32602", token="own"),
    R("mcp-run-code-without-token", "POST /mcp", call("run_code", {"code": "1"}),
      "401 -32001 invalid_token"),
    R("seed-body-id-path", "POST /seed_session", b'{"resources_session_id": "../x"}',
      "400 invalid_session_id"),
    R("seed-expected-stdout-int", "POST /seed_session", b'{"expected_stdout": 5}'),
    R("unknown-route", "GET /spaces", None, NOT_FOUND),
    R("get-run-code", "GET /run_code", None, NOT_ALLOWED),
]
# fmt: on

# One case per route (and every bug) also runs under the rollout prefix.
# fmt: off
_ROLLOUT_NAMES = {
    "step-not-json", "step-cookie-tampered", "action-11", "observe-unknown-field", "reset-list",
    "seed_session-body-id-dotdot", "reset-cookie-vs-body", "verify-list", "close-body-id-nul",
    "close-cookie-vs-body", "aggregate-items", "render-unknown-field",
    "spaces-junk-body-and-cookie", "mcp-not-json", "mcp-token-garbage",
    "mcp-token-of-another-session", "mcp-action-11", "get-step", "run-not-json",
    "seed-id-dotdot", "close-missing-id", "remember-float", "run-code-code-int",
    "mcp-run-code-without-token",
}
# fmt: on


def _all_cases() -> list[Any]:
    cases = [*ENV_CASES, *AGENT_CASES, *REPL_CASES]
    rolled = [
        replace(case, rollout=True) for case in cases if case.name in _ROLLOUT_NAMES or case.bug
    ]
    params = []
    for case in [*cases, *rolled]:
        marks = []
        if case.bug:
            marks.append(pytest.mark.xfail(strict=True, reason=case.bug))
        label = f"{case.kind}-{case.name}" + ("-rollout" if case.rollout else "")
        params.append(pytest.param(case, id=label, marks=marks))
    return params


ALL_CASES = _all_cases()


def test_case_names_are_unique():
    names = [(c.kind, c.name) for c in (*ENV_CASES, *AGENT_CASES, *REPL_CASES)]
    assert len(names) == len(set(names))
    assert {name for _, name in names} >= _ROLLOUT_NAMES


def _describe(reply: Reply) -> tuple[int, Any]:
    """(status, error code) of a reply: framework code, JSON-RPC code, or None."""
    try:
        data = reply.json
    except ValueError:
        return reply.status, f"<not JSON: {reply.raw[:80]!r}>"
    if isinstance(data, dict) and data.get("jsonrpc") == "2.0" and "error" in data:
        return reply.status, data["error"]["code"]
    if isinstance(data, dict) and set(data) == {"error"}:
        assert set(data["error"]) == {"code", "message"}, data
        assert isinstance(data["error"]["message"], str) and data["error"]["message"]
        return reply.status, data["error"]["code"]
    return reply.status, None


async def _send_case(client: aiohttp.ClientSession, stack: Stack, case: Case) -> None:
    url = stack.servers[case.kind].url
    ctx = Ctx()
    if case.sessions:
        seed = dict(case.seed)
        ctx.own = await open_session(client, case.kind, url, seed)
        if case.sessions == 2:
            ctx.other = await open_session(client, case.kind, url)
    headers = dict(case.headers)
    cookie = {"own": ctx.own, "other": ctx.other}.get(case.cookie or "")
    if isinstance(cookie, Session):
        headers["Cookie"] = f"gym_session={cookie.cookie}"
    elif case.cookie:
        headers["Cookie"] = f"gym_session={_forged_cookie(case.cookie, ctx)}"
    token = {"own": ctx.own, "other": ctx.other}.get(case.token or "")
    if isinstance(token, Session):
        assert token.token
        headers[TOKEN] = token.token
    elif case.token:
        headers[TOKEN] = _forged_token(case.token, ctx)
    body = case.body(ctx) if callable(case.body) else case.body
    if body is not None:
        body = body.replace(b'"ENV"', dump(stack.servers["env"].url))
        headers.setdefault("Content-Type", "application/json")
    path = (ROLLOUT + case.path) if case.rollout else case.path

    reply = await send(client, case.method, url + path, body, headers)
    got = _describe(reply)
    assert got in case.expect, (got, reply.raw[:300])
    data = reply.json
    if isinstance(got[1], int):  # a JSON-RPC error
        assert data["jsonrpc"] == "2.0"
        if case.rpc_data:
            assert data["error"]["data"] == {"code": case.rpc_data, "status": reply.status}
    if case.tool_error:
        assert data["result"]["isError"] is True
        assert data["result"]["content"][0]["text"].startswith(case.tool_error + ":")
    if got[1] is None and case.check:
        case.check(data, ctx)
    if got[1] is not None or case.tool_error:
        # An error touches no session's state.
        for session in (ctx.own, ctx.other):
            if session is not None:
                await assert_unharmed(client, case.kind, url, session)


@pytest.mark.parametrize("case", ALL_CASES)
async def test_bad_request_gets_its_error(stack, client, case):
    await asyncio.gather(_send_case(client, stack, case), healthy_episode(client, stack, case.kind))


# ----------------------------------------------------------------------------- bodies


_HUGE_ROUTES = [
    ("env", "/step", False),
    ("env", "/reset", False),
    ("env", "/mcp", True),
    ("env", ROLLOUT + "/verify", False),
    ("agent", "/run", False),
    ("agent", "/v1/agent_sessions", False),
    ("repl", "/run_code", False),
]


async def _upload(url: str, path: str, chunk: bytes, n: int, *, declared: bool) -> Reply:
    """POST ``n`` copies of ``chunk`` while reading the reply, as a careful client does.

    The server may answer 413 and close before the body is sent (at once when the
    declared length is too large); writing then fails, but the reply has arrived.
    """
    reader, writer = await _open(url)
    length = f"Content-Length: {n * len(chunk)}" if declared else "Transfer-Encoding: chunked"
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        f"{length}\r\n\r\n".encode()
    )

    async def write_body() -> None:
        frame = chunk if declared else f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
        try:
            for _ in range(n):
                writer.write(frame)
                await writer.drain()
            if not declared:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except ConnectionError:
            pass  # the server stopped reading: its reply says why

    sending = asyncio.create_task(write_body())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in lines[1:] if line)
        headers = {name.lower(): value for name, value in headers.items()}
        body = await reader.readexactly(int(headers["content-length"]))
        return Reply(int(lines[0].split()[1]), headers, body)
    finally:
        sending.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        writer.close()


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
@pytest.mark.parametrize(("kind", "path", "jsonrpc"), _HUGE_ROUTES)
async def test_100_mib_body_is_413(stack, client, kind, path, jsonrpc, declared):
    chunk = b" " * MIB  # the only copy: the body streams from it 100 times
    upload = _upload(stack.servers[kind].url, path, chunk, 100, declared=declared)
    reply, _ = await asyncio.gather(upload, healthy_episode(client, stack, kind))
    assert reply.status == 413
    if jsonrpc:
        error = reply.json["error"]
        assert error["code"] == -32001
        assert error["data"] == {"code": "body_too_large", "status": 413}
    else:
        assert reply.json["error"]["code"] == "body_too_large"


# ----------------------------------------------------------------------------- raw HTTP


async def _open(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parsed = urlparse(url)
    return await asyncio.open_connection(parsed.hostname, parsed.port)


async def _raw_exchange(url: str, request: bytes) -> bytes:
    reader, writer = await _open(url)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_slow_body_and_slow_headers_are_held_while_others_are_served(stack, client):
    """A body that pauses (for less than body_read_timeout_seconds, 60 s; the unit
    tests show the 408 after it) and headers that pause (uvicorn has no timeout for
    reading headers) are held open, the worker keeps serving everyone else, and the
    request completes when the rest arrives."""
    url = stack.servers["env"].url
    own = await open_session(client, "env", url)
    body = b'{"action": 2}'
    head = (
        b"POST /step HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\n"
        + f"Cookie: gym_session={own.cookie}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    )
    slow_body = await _open(url)
    slow_body[1].write(head + body[:5])
    slow_head = await _open(url)
    slow_head[1].write(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: ")
    await asyncio.gather(slow_body[1].drain(), slow_head[1].drain())

    # Meanwhile every worker serves healthy episodes.
    await asyncio.gather(*[healthy_episode(client, stack, "env") for _ in range(4)])
    await asyncio.sleep(2.5)
    for reader, _ in (slow_body, slow_head):
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.2)  # held: no reply, not closed

    slow_body[1].write(body[5:])
    slow_head[1].write(b"1\r\nConnection: close\r\n\r\n")
    replies = []
    for reader, writer in (slow_body, slow_head):
        await writer.drain()
        replies.append(await asyncio.wait_for(reader.read(), 10))
        writer.close()
    assert replies[0].startswith(b"HTTP/1.1 200 ")
    assert json.loads(replies[0].split(b"\r\n\r\n", 1)[1])["observation"] == 9
    assert replies[1].startswith(b"HTTP/1.1 200 ")


async def test_oversized_headers_get_431_and_the_worker_goes_on(stack, client):
    """Header sections over max_header_bytes (64 KiB) get 431 headers_too_large before
    any routing (so they are never forwarded); many small headers under the limit are
    served as usual."""
    url = stack.servers["env"].url
    own = await open_session(client, "env", url)
    pad = "p" * 100_000
    for _ in range(8):  # new connections: at 4 workers these land on every worker
        headers = {"Cookie": f"gym_session={own.cookie}", "X-Pad": pad}
        reply = await send(client, "POST", url + "/observe", b"{}", headers)
        assert (reply.status, reply.json["error"]["code"]) == (431, "headers_too_large")
    many = {f"X-H{i}": "v" for i in range(2000)}
    reply = await send(
        client, "POST", url + "/observe", b"{}", {"Cookie": f"gym_session={own.cookie}", **many}
    )
    assert (reply.status, reply.json["observation"]) == (200, 7)
    reply = await send(client, "POST", url + "/observe", b"{}", {"Cookie": f"gym_session={pad}"})
    assert (reply.status, reply.json["error"]["code"]) == (431, "headers_too_large")
    await healthy_episode(client, stack, "env")


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"FOO /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n", 400),
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /step HTTP/1.1\r\nHost: t\r\nContent-Length: abc\r\n\r\n", 400),
        (b"GET /health HTTP/9.9\r\nHost: t\r\n\r\n", 400),
    ],
    ids=["unknown-method", "garbage", "bad-content-length", "bad-version"],
)
async def test_unparseable_requests_get_uvicorns_400(stack, client, request_bytes, status):
    """uvicorn refuses what its parser cannot read before the app runs: a plain-text
    400 "Invalid HTTP request received." (not the framework's JSON body), and the
    connection is closed."""
    url = stack.servers["env"].url
    raw, _ = await asyncio.gather(
        _raw_exchange(url, request_bytes), healthy_episode(client, stack, "env")
    )
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), raw[:200]
    assert body == b"Invalid HTTP request received."


async def test_trailing_slash_redirects(stack, client):
    """Starlette's slash redirect: ``/step/`` answers 307 to ``/step`` (not an error)."""
    url = stack.servers["env"].url
    reply = await send(client, "POST", url + "/step/", b'{"action": 1}')
    assert reply.status == 307
    assert reply.headers["location"] == url + "/step"


async def test_head_of_a_post_route_is_405_without_body(stack, client):
    reply = await send(client, "HEAD", stack.servers["env"].url + "/step")
    assert (reply.status, reply.raw) == (405, b"")


# ----------------------------------------------------------------------------- liveness


# The exceptions behind the strict-xfail bugs above: uvicorn logs each 500 internal_error.
KNOWN_BUG_EXCEPTIONS: set[str] = set()


def _unhandled_exceptions(log: str) -> list[str]:
    """The final exception line of every "Exception in ASGI application" in a server log."""
    found = []
    for chunk in log.split("Exception in ASGI application")[1:]:
        last = ""
        for line in chunk.splitlines()[1:]:
            if line.startswith(("ERROR:", "WARNING:", "INFO:", "gym-sessions")):
                break
            if (
                line
                and not line[0].isspace()
                and not line.startswith(("Traceback", "During", "The above"))
            ):
                last = line
        found.append(last)
    return found


@pytest.mark.parametrize("kind", ["env", "agent", "repl"])
def test_no_worker_died(stack, kind):
    """Every worker that started still answers, none was replaced, and every
    exception that escaped to uvicorn is one of the recorded bugs."""
    server = stack.servers[kind]
    assert server.process.poll() is None
    after = _probe_worker_ids(server.url, stack.workers)
    assert after == stack.worker_ids[kind]
    assert set(_unhandled_exceptions(server.log())) <= KNOWN_BUG_EXCEPTIONS
