"""The per-session Python interpreter example (`envs.python_repl`) against real servers.

As root the servers run sandboxed (a uid per interpreter); otherwise they are
started with ``--unsandboxed``, which a server that is not root requires.
`tests/e2e/test_repl_sandbox.py` tests the sandbox itself.
"""

from __future__ import annotations

import ast
import asyncio
import glob
import os
import time
from typing import Any

import aiohttp
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from envs.counter_load import client_session
from envs.python_repl import CHILD_MARKER  # a module that cannot import fails this file loudly
from gym_sessions.server.process import ServerProcess
from tests.polling import eventually

from ..conftest import require_or_skip

# One xdist group: their servers share the host-wide uid range of the sandbox.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group("repl_sandbox")]

REPL = "envs.python_repl:PythonReplServer"
# Not root: no sandbox, so the server refuses to start unless told to run unsandboxed.
# REPL_TESTS_UNSANDBOXED=1 runs these tests unsandboxed as root too.
UNSANDBOXED = os.geteuid() != 0 or os.environ.get("REPL_TESTS_UNSANDBOXED") == "1"
MODE_ARGS: tuple[str, ...] = ("--unsandboxed",) if UNSANDBOXED else ()
CHILD_SCRIPT = CHILD_MARKER  # an argument of every interpreter's command line
COOKIE = "gym_session"
TOKEN = "X-Gym-Session-Token"
SESSIONS = 50


@pytest.fixture(autouse=True)
def sandbox_programs() -> None:
    """Sandboxed, the server needs util-linux's prlimit and setpriv: else skip (CI: fail)."""
    if not UNSANDBOXED:
        for program in ("prlimit", "setpriv"):
            require_or_skip(program, "util-linux")


# Client side ---------------------------------------------------------------------------


async def post(
    client: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    cookie: str | None = None,
    **headers: str,
) -> tuple[int, dict[str, Any], str | None]:
    """``POST path``; returns status, reply and the session cookie (new or as sent)."""
    if cookie:
        headers["Cookie"] = f"{COOKIE}={cookie}"
    async with client.post(url + path, json=body, headers=headers) as reply:
        morsel = reply.cookies.get(COOKIE)
        return reply.status, await reply.json(), morsel.value if morsel else cookie


async def run_code(
    client: aiohttp.ClientSession, url: str, code: str, cookie: str | None = None, **arguments: Any
) -> tuple[int, dict[str, Any], str | None]:
    return await post(client, url, "/run_code", {"code": code, **arguments}, cookie)


async def live_interpreters(client: aiohttp.ClientSession, url: str) -> int:
    """``sessions`` of ``GET /health`` (use with one worker: each worker counts its own)."""
    async with client.get(url + "/health") as reply:
        return (await reply.json())["sessions"]


async def x_then_print(client: aiohttp.ClientSession, url: str, n: int) -> tuple[bool, str]:
    """``x = n`` then ``print(x + 1)`` by cookie, each on its own connection; right and cookie."""
    status, _, cookie = await run_code(client, url, f"x = {n}")
    assert status == 200 and cookie
    status, data, _ = await run_code(client, url, "print(x + 1)", cookie)
    return status == 200 and data["stdout"] == f"{n + 1}\n", cookie


async def x_then_print_all(url: str, n: int = SESSIONS) -> list[tuple[bool, str]]:
    async with client_session() as client:
        return await asyncio.gather(*[x_then_print(client, url, 1000 + i) for i in range(n)])


# Processes -----------------------------------------------------------------------------


def _descendants(pid: int) -> list[int]:
    found = []
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(path) as file:
                children = [int(child) for child in file.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


def _is_interpreter(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            state = file.read().rpartition(")")[2].split()[0]
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            cmdline = file.read()
    except OSError:
        return False
    return state == "Z" or CHILD_SCRIPT.encode() in cmdline


def interpreter_processes(server: ServerProcess) -> list[int]:
    """Interpreters (or unreaped zombies) below the server's supervisor, over all workers."""
    try:
        import psutil
    except ImportError:
        return [pid for pid in _descendants(server.process.pid) if _is_interpreter(pid)]
    found = []
    for process in psutil.Process(server.process.pid).children(recursive=True):
        try:
            if process.status() == psutil.STATUS_ZOMBIE or any(
                CHILD_SCRIPT in part for part in process.cmdline()
            ):
                found.append(process.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def claim_owners(server: ServerProcess) -> set[str]:
    """The workers that hold claims now."""
    owners = set()
    for path in server.claim_files():
        with open(path) as file:
            owners.add(file.read())
    return owners


async def no_interpreters_left(server: ServerProcess) -> bool:
    async def none() -> bool:
        return not interpreter_processes(server)

    return await eventually(none)


# Tests ---------------------------------------------------------------------------------


async def test_one_session_is_one_interpreter_like_a_repl(serve):
    server = serve(REPL, *MODE_ARGS)
    async with client_session() as client:
        status, data, cookie = await run_code(client, server.url, "x = 41\nx + 1")
        assert status == 200
        assert data == {"stdout": "", "stderr": "", "value": "42", "error": None}
        _, data, _ = await run_code(
            client, server.url, "import sys\nprint(x, file=sys.stderr)", cookie
        )
        assert data["stderr"] == "41\n" and data["value"] is None
        _, data, _ = await run_code(client, server.url, "print('a')\n1 / 0", cookie)
        assert data["stdout"] == "a\n"
        assert data["error"].startswith('Traceback (most recent call last):\n  File "<cell')
        assert data["error"].endswith("ZeroDivisionError: division by zero\n")
        _, data, _ = await run_code(client, server.url, "def f(:", cookie)
        assert "SyntaxError" in data["error"]
        # Writes to fd 1 and reads of stdin cannot reach the protocol channel.
        code = "import os\nos.write(1, b'noise\\n')\nprint('ok')\ninput()"
        _, data, _ = await run_code(client, server.url, code, cookie)
        assert data["stdout"] == "ok\n" and "EOFError" in data["error"]
        _, data, _ = await run_code(client, server.url, "x", cookie)
        assert data["value"] == "41"
        status, data, _ = await run_code(client, server.url, "x", cookie, timeout=61)
        assert status == 400 and data["error"]["code"] == "invalid_request"


def test_http_sessions_keep_their_variables_at_4_workers_and_close_cleanly(serve):
    server = serve(REPL, *MODE_ARGS, workers=4)

    async def scenario() -> None:
        results = await x_then_print_all(server.url)
        assert [right for right, _ in results].count(True) == SESSIONS
        assert (
            len(claim_owners(server)) > 1
        )  # the sessions lived on several workers: routing was used
        assert len(interpreter_processes(server)) == SESSIONS
        async with client_session() as client:
            closes = await asyncio.gather(
                *[post(client, server.url, "/close_session", {}, cookie) for _, cookie in results]
            )
        assert all(status == 200 and data["outcome"] == "closed" for status, data, _ in closes)
        assert await no_interpreters_left(server), interpreter_processes(server)

    asyncio.run(scenario())


async def _mcp_x_then_print(client: aiohttp.ClientSession, url: str, n: int) -> bool:
    status, start, _ = await post(client, url, "/seed_session", {})
    assert status == 200
    headers = {TOKEN: start["mcp"]["headers"][TOKEN]}
    stdout = None
    for i, code in enumerate([f"x = {n}", "print(x + 1)"]):
        call = {
            "jsonrpc": "2.0",
            "id": i,
            "method": "tools/call",
            "params": {"name": "run_code", "arguments": {"code": code}},
        }
        async with client.post(url + "/mcp", json=call, headers=headers) as reply:
            result = (await reply.json())["result"]
        assert result["isError"] is False, result
        stdout = result["structuredContent"]["stdout"]
    return stdout == f"{n + 1}\n"


async def test_mcp_sessions_keep_their_variables_at_4_workers(serve):
    server = serve(REPL, *MODE_ARGS, workers=4)
    async with client_session() as client:
        done = await asyncio.gather(
            *[_mcp_x_then_print(client, server.url, 2000 + i) for i in range(SESSIONS)]
        )
        assert done.count(True) == SESSIONS
        status, start, _ = await post(client, server.url, "/seed_session", {})
        assert status == 200
    http = httpx2.AsyncClient(
        headers={TOKEN: start["mcp"]["headers"][TOKEN]}, timeout=httpx2.Timeout(30, read=60)
    )
    mcp = Client(streamable_http_client(server.url + "/mcp", http_client=http), mode="legacy")
    async with http, mcp:
        tools = {tool.name: tool for tool in (await mcp.list_tools()).tools}
        assert set(tools) == {"run_code"}
        assert tools["run_code"].input_schema["required"] == ["code"]
        assert not (await mcp.call_tool("run_code", {"code": "x = 41"})).is_error
        result = await mcp.call_tool("run_code", {"code": "print(x + 1)"})
        assert result.structured_content == {
            "stdout": "42\n",
            "stderr": "",
            "value": None,
            "error": None,
        }
        hung = await mcp.call_tool("run_code", {"code": "while True: pass", "timeout": 0.5})
        assert hung.is_error and "timed out" in hung.content[0].text


async def test_a_hanging_or_crashing_interpreter_fails_its_call_only(serve):
    server = serve(REPL, *MODE_ARGS)  # one worker: both sessions share one event loop
    async with client_session() as client:
        # The interpreter's own directory: sandboxed, it may write nowhere else of ours.
        _, data, hung = await run_code(client, server.url, "y = 7\nimport os\nos.getcwd()")
        started = os.path.join(ast.literal_eval(data["value"]), "hang-started")
        _, _, other = await run_code(client, server.url, "x = 0")
        hang_code = "open('hang-started', 'w').close()\nwhile True: pass"
        began = time.monotonic()
        hang = asyncio.create_task(run_code(client, server.url, hang_code, hung, timeout=2))
        assert await eventually(lambda: asyncio.to_thread(os.path.exists, started))
        for _ in range(3):
            status, data, _ = await run_code(client, server.url, "x += 1\nx", other)
            assert status == 200
        assert data["value"] == "3"
        assert not hang.done()  # the other session was served during the hang
        status, data, _ = await hang
        assert time.monotonic() - began < 8
        assert status == 500 and data["error"]["code"] == "env_error"
        assert "timed out after 2 s" in data["error"]["message"]
        _, data, _ = await run_code(client, server.url, "y", hung)
        assert "NameError" in data["error"]  # a fresh interpreter
        _, data, _ = await run_code(client, server.url, "1 + 1", hung)
        assert data["value"] == "2"

        status, data, _ = await run_code(client, server.url, "import os; os._exit(3)", hung)
        assert status == 500 and data["error"]["code"] == "env_error"
        assert "exited with code 3" in data["error"]["message"]
        _, data, _ = await run_code(client, server.url, "z = 5\nz", hung)
        assert data == {"stdout": "", "stderr": "", "value": "5", "error": None}
        _, data, _ = await run_code(client, server.url, "x", other)
        assert data["value"] == "3"
        assert await live_interpreters(client, server.url) == 2


async def test_closed_and_verified_sessions_leave_no_interpreter(serve):
    server = serve(REPL, *MODE_ARGS)
    url = server.url
    async with client_session() as client:
        cookies = [cookie for _, cookie in [await x_then_print(client, url, n) for n in range(4)]]
        status, _, seeded = await post(client, url, "/seed_session", {"expected_stdout": "hi\n"})
        assert status == 200
        await run_code(client, url, "v = 1", seeded)
        # A new episode of the session discards its interpreter (a repeated seed would
        # return the open session as it is).
        await post(client, url, "/reset", {"expected_stdout": "hi\n"}, seeded)
        _, data, _ = await run_code(client, url, "print('hi')\n'v' in dir()", seeded)
        assert data["stdout"] == "hi\n" and data["value"] == "False"
        assert await live_interpreters(client, url) == 5
        assert len(interpreter_processes(server)) == 5

        _, data, _ = await post(client, url, "/close_session", {}, cookies[0])
        assert data["outcome"] == "closed"
        _, data, _ = await post(client, url, "/close_session", {}, cookies[0])
        assert data["outcome"] == "already_closed"
        _, data, _ = await post(client, url, "/verify", {"expected_stdout": "2\n"}, cookies[1])
        assert data["reward"] == 1.0
        follows = {"x-gym-close-follows": "1"}
        _, data, _ = await post(
            client, url, "/verify", {"expected_stdout": "?"}, cookies[2], **follows
        )
        assert data["reward"] == 0.0
        assert await live_interpreters(client, url) == 3  # the close follows: still alive
        _, data, _ = await post(client, url, "/verify", {}, seeded)  # the start's expected_stdout
        assert data["reward"] == 1.0
        for cookie in cookies[2:]:
            _, data, _ = await post(client, url, "/close_session", {}, cookie)
            assert data["outcome"] == "closed"
        status, data, _ = await run_code(client, url, "x", cookies[3])
        assert status == 409 and data["error"]["code"] == "session_closed"
        assert await live_interpreters(client, url) == 0
        assert await no_interpreters_left(server), interpreter_processes(server)


async def test_an_unclosed_session_is_killed_when_its_window_ends(serve):
    server = serve(REPL, "--window", "1", *MODE_ARGS)
    url = server.url
    async with client_session() as client:
        _, start, _ = await post(client, url, "/seed_session", {})
        seeded = {TOKEN: start["mcp"]["headers"][TOKEN]}
        call = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "run_code", "arguments": {"code": "kept = 1"}},
        }
        async with client.post(url + "/mcp", json=call, headers=seeded) as reply:
            assert (await reply.json())["result"]["isError"] is False
        status, _, _ = await run_code(client, url, "lost = 1")
        assert status == 200
        began = time.monotonic()
        assert await live_interpreters(client, url) == 2

        async def one_left() -> bool:
            return await live_interpreters(client, url) == 1

        assert await eventually(one_left, within=10)
        waited = time.monotonic() - began
        print(f"\nwindow 1 s: the unclosed session's interpreter was killed after {waited:.1f} s")
        assert len(interpreter_processes(server)) == 1
        # The started session is open: its claim, and its interpreter, outlive the window.
        await asyncio.sleep(1.0)
        call["params"]["arguments"]["code"] = "kept"
        async with client.post(url + "/mcp", json=call, headers=seeded) as reply:
            assert (await reply.json())["result"]["structuredContent"]["value"] == "1"


def test_without_routing_four_workers_lose_variables(serve):
    server = serve(REPL, "--no-routing", *MODE_ARGS, workers=4)
    right = [ok for ok, _ in asyncio.run(x_then_print_all(server.url))].count(True)
    print(f"\n--no-routing, 4 workers: {right} of {SESSIONS} sessions printed their own x + 1")
    assert right < SESSIONS
