"""Security properties with real servers: private runtime files, secrets, signed credentials.

- The runtime directory, ``claims/`` and ``workers/`` are mode 0700 and the
  private sockets 0600; another user cannot connect to a private socket.
- There is no fixed default secret: two servers started without one sign
  differently, and a cookie or token of one is treated as absent by the other.
- Cookies and tokens are verified: re-signed, spliced, expired or foreign ones
  never name a session.
- A valid cookie of session A never reaches session B's state, whatever else the
  request carries (B's id in the body, B's token, spliced payloads).
- Claim files are named by the sha256 hex of the id; odd ids create nothing
  anywhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import socket
import stat
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import itsdangerous
import pytest

from gym_sessions.credentials import COOKIE_MAX_AGE_SECONDS, SessionCredentials
from gym_sessions.secret_source import write_secret_file
from gym_sessions.settings import SECRET_ENV, Settings
from tests.services import claim_owner

pytestmark = pytest.mark.e2e

COUNTER = "envs.counter:CounterEnv"
TOKEN = "X-Gym-Session-Token"
SECRET = "security-test-secret-" + "q" * 24
NOBODY = 65534


# ----------------------------------------------------------------------------- helpers


@dataclass
class Reply:
    status: int
    json: Any
    cookie: str | None


@dataclass
class Session:
    sid: str
    cookie: str
    token: str


@pytest.fixture
def secret_file(tmp_path) -> str:
    """A 0600 file holding `SECRET`, for ``--secret-file``."""
    path = str(tmp_path / "secret")
    write_secret_file(path, SECRET)
    return path


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """A new connection per request (so requests land on any worker), no cookie jar."""
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(force_close=True),
        cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=30),
    ) as session:
        yield session


async def post(
    client: aiohttp.ClientSession,
    url: str,
    body: Any = None,
    *,
    cookie: str | None = None,
    headers: dict[str, str] | None = None,
) -> Reply:
    send_headers = dict(headers or {})
    if cookie is not None:
        send_headers["Cookie"] = f"gym_session={cookie}"
    async with client.post(url, json=body, headers=send_headers) as reply:
        morsel = reply.cookies.get("gym_session")
        return Reply(
            reply.status, await reply.json(content_type=None), morsel.value if morsel else None
        )


async def start(
    client: aiohttp.ClientSession, url: str, initial: int, sid: str | None = None
) -> Session:
    body: dict[str, Any] = {"options": {"initial_count": initial}}
    if sid is not None:
        body["resources_session_id"] = sid
    reply = await post(client, url + "/reset", body)
    assert reply.status == 200, reply.json
    assert reply.cookie
    return Session(
        reply.json["resources_session_id"], reply.cookie, reply.json["mcp"]["headers"][TOKEN]
    )


async def observe(client: aiohttp.ClientSession, url: str, **kw: Any) -> Reply:
    return await post(client, url + "/observe", {}, **kw)


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments},
    }


def error_code(reply: Reply) -> Any:
    error = reply.json.get("error") if isinstance(reply.json, dict) else None
    if not error:
        return None
    return error["data"]["code"] if "data" in error else error["code"]


def mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# ----------------------------------------------------------------------------- runtime directory


async def test_runtime_directory_claims_and_sockets_are_private(serve, client):
    server = serve(COUNTER, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    for session in range(8):
        await start(client, server.url, session)
    assert mode(runtime_dir) == 0o700
    assert mode(os.path.join(runtime_dir, "claims")) == 0o700
    assert mode(os.path.join(runtime_dir, "workers")) == 0o700
    sockets = server.worker_sockets()
    assert len(sockets) == 4
    for path in sockets:
        info = os.lstat(path)
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_uid == os.getuid()
    claims = server.claim_files()
    assert len(claims) == 8
    for path in claims:
        assert mode(path) == 0o600
    server.stop()
    assert server.runtime_dirs() == []  # removed when the server exits


def _as_nobody(action, *args: Any) -> int:
    """Run ``action(*args)`` in a forked child as uid/gid 65534; its exit code is the result."""
    pid = os.fork()
    if pid == 0:  # the child: only syscalls, then _exit
        code = 99
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = action(*args)
        except BaseException:
            code = 98
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


CONNECTED, REFUSED_PERMISSION, OTHER_ERROR = 0, 10, 11  # the child's exit codes


def _connect(path: str) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except PermissionError:
            return REFUSED_PERMISSION
        except OSError:
            return OTHER_ERROR
    return CONNECTED


def _read(path: str) -> int:
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            with open(path, "rb") as file:
                file.read(1)
    except PermissionError:
        return REFUSED_PERMISSION
    except OSError:
        return OTHER_ERROR
    return CONNECTED


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as another user (setuid)")
def test_another_user_cannot_reach_private_sockets_claims_or_the_secret(serve, short_tmp):
    server = serve(COUNTER, workers=2)
    (runtime_dir,) = server.runtime_dirs()
    sockets = server.worker_sockets()
    workers_dir = os.path.join(runtime_dir, "workers")
    # Let the other user walk down to the runtime directory, so only its own modes stop it.
    os.chmod(short_tmp, 0o755)
    os.chmod(server.tmpdir, 0o755)

    # Control: the same child reaches a socket that is open to everyone.
    open_dir = tempfile.mkdtemp(prefix="gs-open-", dir="/tmp")
    try:
        os.chmod(open_dir, 0o777)
        control_path = os.path.join(open_dir, "open.sock")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(control_path)
            os.chmod(control_path, 0o777)
            listener.listen(4)
            assert _as_nobody(_connect, control_path) == CONNECTED
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(open_dir, "open.sock"))
        os.rmdir(open_dir)

    # The runtime directory (0700) stops the other user at once.
    for path in sockets:
        assert _as_nobody(_connect, path) == REFUSED_PERMISSION
    assert _as_nobody(_read, runtime_dir) == REFUSED_PERMISSION
    # Nor are the supervisor's and the workers' environments (never the secret's way
    # to the workers; test_secrets.py shows that and what keeps out the same user).
    worker_pids = [int(os.path.basename(p).split("-")[0]) for p in sockets]
    for pid in [server.process.pid, *worker_pids]:
        assert _as_nobody(_read, f"/proc/{pid}/environ") == REFUSED_PERMISSION

    # Even with the directories opened for traversal, each socket (0600) refuses.
    try:
        os.chmod(runtime_dir, 0o711)
        os.chmod(workers_dir, 0o711)
        for path in sockets:
            assert _as_nobody(_connect, path) == REFUSED_PERMISSION
    finally:
        os.chmod(workers_dir, 0o700)
        os.chmod(runtime_dir, 0o700)
    assert server.health()["status"] == "ok"


# ----------------------------------------------------------------------------- secrets


async def test_no_fixed_default_secret(serve, client, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    first, second = Settings(), Settings()
    assert first.secret != second.secret
    assert len(first.secret) >= 32 and len(second.secret) >= 32

    a = serve(COUNTER, workers=2)
    b = serve(COUNTER)
    sid = "same-id-" + uuid.uuid4().hex
    on_a = await start(client, a.url, 11, sid)
    on_b = await start(client, b.url, 22, sid)
    assert on_a.cookie.split(".")[-1] != on_b.cookie.split(".")[-1]
    # Each server reads its own cookie ...
    for server, session, count in ((a, on_a, 11), (b, on_b, 22)):
        reply = await observe(client, server.url, cookie=session.cookie)
        assert (reply.status, reply.json["observation"]) == (200, count)
    # ... and treats the other's as absent, though it names a session it holds.
    for server, session in ((a, on_b), (b, on_a)):
        reply = await observe(client, server.url, cookie=session.cookie)
        assert (reply.status, error_code(reply)) == (404, "no_open_episode")
        reply = await post(client, server.url + "/reset", {}, cookie=session.cookie)
        assert reply.status == 200 and reply.json["resources_session_id"] != sid
        reply = await post(
            client,
            server.url + "/mcp",
            tool_call("observe", {}),
            headers={TOKEN: session.token},
        )
        assert (reply.status, error_code(reply)) == (401, "invalid_token")


def test_secret_from_the_environment(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "from-the-environment-" + "e" * 20)
    assert Settings().secret == Settings().secret == "from-the-environment-" + "e" * 20


class _OldSigner(itsdangerous.TimestampSigner):
    def get_timestamp(self) -> int:
        return int(time.time()) - COOKIE_MAX_AGE_SECONDS - 60


async def test_cookies_and_tokens_are_signed_and_verified(serve, client, secret_file):
    server = serve(COUNTER, "--secret-file", secret_file)
    own = await start(client, server.url, 5)
    right = SessionCredentials(SECRET, "gym_session")
    wrong = SessionCredentials("not-the-secret-" + "w" * 24, "gym_session")

    # Control: the server signs with the secret, and a cookie we sign with it is read.
    own_data = right.decode_cookie(own.cookie)
    assert own_data is not None and own_data["session_id"] == own.sid
    own_token = right.read_token(own.token)
    assert own_token is not None and own_token.session_id == own.sid
    reply = await observe(client, server.url, cookie=right.encode_cookie(own_data))
    assert (reply.status, reply.json["observation"]) == (200, 5)

    victim = await start(client, server.url, 500)
    payload = victim.cookie.split(".", 1)[0]
    expired = _OldSigner(SECRET).sign(
        own.cookie.split(".", 1)[0].encode()  # the same payload, signed 14 days + 1 min ago
    )
    forged = {
        "re-signed with another key": wrong.encode_cookie(own_data),
        "spliced onto another payload": payload + "." + own.cookie.split(".", 1)[1],
        "expired": expired.decode(),
        "a token": own.token,
        "truncated": own.cookie[:-1],
    }
    for what, cookie in forged.items():
        reply = await observe(client, server.url, cookie=cookie)
        assert (reply.status, error_code(reply)) == (404, "no_open_episode"), what
        step = await post(client, server.url + "/step", {"action": 1}, cookie=cookie)
        assert (step.status, error_code(step)) == (404, "no_open_episode"), what

    for what, token in {
        "signed with another key": wrong.mint_token(own.sid, own_token.incarnation),
        "a cookie": own.cookie,
        "truncated": own.token[:-2],
        "another salt": itsdangerous.URLSafeSerializer(SECRET, salt="other").dumps(
            {"sid": own.sid}
        ),
    }.items():
        reply = await post(
            client, server.url + "/mcp", tool_call("observe", {}), headers={TOKEN: token}
        )
        assert (reply.status, error_code(reply)) == (401, "invalid_token"), what
        # Over HTTP a bad token names no session either.
        reply = await observe(client, server.url, headers={TOKEN: token})
        assert (reply.status, error_code(reply)) == (404, "no_open_episode"), what
    # Nothing above touched either session.
    for session, count in ((own, 5), (victim, 500)):
        reply = await observe(client, server.url, cookie=session.cookie)
        assert reply.json == {"observation": count, "episode_length": 0}


# ----------------------------------------------------------------------------- isolation


async def test_a_cookie_of_session_a_never_reaches_session_b(serve, client):
    server = serve(COUNTER, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    url = server.url
    a = await start(client, url, 1000)
    for _ in range(40):  # B on another worker than A
        b = await start(client, url, -1000)
        if claim_owner(runtime_dir, b.sid) != claim_owner(runtime_dir, a.sid):
            break
    assert claim_owner(runtime_dir, a.sid) != claim_owner(runtime_dir, b.sid)

    mcp_observe = tool_call("observe", {})
    names_b = {"resources_session_id": b.sid}
    conflict = {(409, "session_conflict")}
    token_off_mcp = {(403, "forbidden")}  # a token reaches only MCP tool calls
    other_token = {(401, "invalid_token")}  # a token of another session than the cookie's
    spliced_token = b.token[: len(b.token) // 2] + a.token[len(a.token) // 2 :]
    # (path, body, cookie, extra headers, allowed replies); "A" means A's own state.
    swaps: list[tuple[str, Any, str | None, dict[str, str], set[Any]]] = [
        ("/observe", {}, a.cookie, {}, {"A"}),
        ("/observe", {}, a.cookie, {TOKEN: b.token}, {"A"}),
        ("/rollouts/x/observe", {}, a.cookie, {TOKEN: b.token}, {"A"}),
        ("/step", {"action": 0}, a.cookie, {TOKEN: b.token}, {"A"}),
        ("/reset", names_b, a.cookie, {}, conflict),
        ("/seed_session", names_b, a.cookie, {}, conflict),
        ("/close_session", names_b, a.cookie, {}, conflict),
        ("/reset", names_b, None, {TOKEN: a.token}, token_off_mcp),
        ("/close_session", names_b, None, {TOKEN: a.token}, token_off_mcp),
        ("/mcp", mcp_observe, a.cookie, {TOKEN: b.token}, other_token),
        ("/mcp", mcp_observe, b.cookie, {TOKEN: a.token}, other_token),
        ("/observe", {}, b.cookie.split(".", 1)[0] + "." + a.cookie.split(".", 1)[1], {},
         {(404, "no_open_episode")}),
        ("/mcp", mcp_observe, None, {TOKEN: spliced_token}, {(401, "invalid_token")}),
        ("/verify", names_b, a.cookie, {"x-gym-close-follows": "1"}, {"A"}),
    ]  # fmt: skip
    for _ in range(6):  # new connections: each lands on any worker
        for path, body, cookie, headers, allowed in swaps:
            reply = await post(client, url + path, body, cookie=cookie, headers=headers)
            text = json.dumps(reply.json)
            assert "-1000" not in text, (path, reply.json)  # never B's count
            if reply.status == 200:
                data = reply.json
                if path == "/mcp":
                    data = data["result"]["structuredContent"]
                count = data.get("observation", data.get("count"))
                assert "A" in allowed and count == 1000, (path, reply.json)
            else:
                assert (reply.status, error_code(reply)) in allowed, (path, reply.json)
    # Both sessions still hold exactly their own state.
    assert (await observe(client, url, cookie=a.cookie)).json["observation"] == 1000
    assert (await observe(client, url, cookie=b.cookie)).json == {
        "observation": -1000,
        "episode_length": 0,
    }


# ----------------------------------------------------------------------------- claim files

VALID_ODD_IDS = ["a..b", "x:y@z", "A.-_:@9", "z" * 128, "0", "a..-..b", "e.:.:.@@"]
INVALID_IDS = [
    "../../x",
    "../x",
    "a/b",
    "/abs",
    "a\x00b",
    "x" * 10_000,
    "x" * 129,
    "é",
    "",
    ".hidden",
    "-dash",
    "a b",
    "a\\b",
]


def _tree(root: str) -> list[str]:
    found = []
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            found.append(os.path.relpath(os.path.join(directory, name), root))
    return sorted(found)


async def test_claim_files_are_sha256_names_and_nothing_else_is_written(
    serve, client, short_tmp, secret_file
):
    server = serve(COUNTER, "--secret-file", secret_file, workers=4)
    (runtime_dir,) = server.runtime_dirs()
    credentials = SessionCredentials(SECRET, "gym_session")
    claimed: set[str] = set()
    for sid in VALID_ODD_IDS:
        session = await start(client, server.url, 1, sid)
        assert session.sid == sid
        claimed.add(sid)
    for sid in INVALID_IDS:
        for path in ("/reset", "/seed_session", "/close_session"):
            reply = await post(client, server.url + path, {"resources_session_id": sid})
            assert (reply.status, error_code(reply)) == (400, "invalid_session_id"), (path, sid)
        # Correctly signed cookies and tokens naming such ids name no session (a token
        # of no current incarnation is refused as such).
        cookie = credentials.encode_cookie({"session_id": sid, "incarnation": "any"})
        reply = await observe(client, server.url, cookie=cookie)
        assert (reply.status, error_code(reply)) == (404, "no_open_episode")
        reply = await post(client, server.url + "/reset", {}, cookie=cookie)
        assert reply.status == 200 and reply.json["resources_session_id"] != sid
        claimed.add(reply.json["resources_session_id"])
        reply = await post(
            client,
            server.url + "/mcp",
            tool_call("observe", {}),
            headers={TOKEN: credentials.mint_token(sid, "any")},
        )
        assert (reply.status, error_code(reply)) == (401, "invalid_token")

    await asyncio.sleep(0.2)
    tree = _tree(server.tmpdir)
    runtime_name = os.path.basename(runtime_dir)
    worker_ids = sorted(os.path.basename(p)[: -len(".sock")] for p in server.worker_sockets())
    expected = sorted(
        [
            "server.log",
            runtime_name,
            f"{runtime_name}/claims",
            f"{runtime_name}/workers",
            *(f"{runtime_name}/workers/{w}.sock" for w in worker_ids),
            # Each worker's connection handoff socket (docs/design.md §3.10.6).
            *(f"{runtime_name}/workers/{w}.fds" for w in worker_ids),
            # Shutdown coordination: one mark per serving worker, named by its id.
            f"{runtime_name}/states",
            *(f"{runtime_name}/states/{w}.serving" for w in worker_ids),
            *(
                f"{runtime_name}/claims/{hashlib.sha256(sid.encode()).hexdigest()}"
                for sid in claimed
            ),
            # prometheus_client's multiprocess files, named by kind and worker pid.
            f"{runtime_name}/metrics",
            # Durable sessions' snapshots (none: this server is not durable).
            f"{runtime_name}/snapshots",
            # Balanced placement's load board: one record per worker, named by its id.
            f"{runtime_name}/load",
            *(f"{runtime_name}/load/{w}" for w in worker_ids),
        ]
    )
    worker_pids = {w.split("-", 1)[0] for w in worker_ids}
    metrics_files = [p for p in tree if p.startswith(f"{runtime_name}/metrics/")]
    for path in metrics_files:
        match = re.fullmatch(
            r"(counter|histogram|gauge_live(all|sum))_(\d+)\.db", path.split("/")[-1]
        )
        assert match and match.group(3) in worker_pids, path
    assert [p for p in tree if p not in metrics_files] == expected
    for path in server.claim_files():
        assert re.fullmatch(r"[0-9a-f]{64}", os.path.basename(path))
        with open(path) as file:
            assert file.read() in worker_ids
    # Nothing was created where a path built from an id would have pointed.
    claims_dir = os.path.join(runtime_dir, "claims")
    for sid in ("../../x", "../x", "/abs"):
        target = os.path.normpath(os.path.join(claims_dir, sid))
        assert not os.path.exists(target), target
    assert sorted(os.listdir(short_tmp)) == [os.path.basename(server.tmpdir)]


async def test_one_worker_writes_no_runtime_files(serve, client):
    server = serve(COUNTER)
    for sid in VALID_ODD_IDS:
        await start(client, server.url, 0, sid)
    assert _tree(server.tmpdir) == ["server.log"]
