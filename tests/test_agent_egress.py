"""What an agent's ``/run`` may call, and what it tells its client about the upstreams (issue 33).

Loopback only: small asyncio servers stand in for a local service that must not
leak (its reply holds a secret) or be reached at all, for one that accepts and
never answers, and for one whose reply is too large or a redirect.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from envs.counter import CounterEnv
from envs.counter_agent import CounterAgent
from gym_sessions.errors import BadUpstreamError, ForbiddenTargetError
from gym_sessions.server.app import WorkerApp
from gym_sessions.settings import Settings
from gym_sessions.spaces import space_to_json
from tests.asgi import asgi_request

SECRET = "s" * 40
LEAK = "INTERNAL-SECRET-BODY admin-token=hunter2"


# Short upstream timeouts, as a deployment sets them (--upstream-connect-timeout,
# --upstream-timeout); every test agent here runs with them.
QUICK = {"upstream_connect_timeout": 0.5, "upstream_timeout": 0.5}


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _serve(handler: Handler) -> tuple[asyncio.Server, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def _answering(status: str, body: bytes, content_type: str) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\n"
        head += f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        writer.close()

    return handle


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(3600)  # accepts, reads nothing, never answers


@pytest.fixture
async def upstream() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> str:
        server, url = await _serve(handler)
        servers.append(server)
        return url

    yield start
    for server in servers:
        server.close()


def _run_body(env_url: str) -> dict[str, Any]:
    return {"env_url": env_url, "task": {"increments": [1]}}


async def _run(agent: CounterAgent, body: dict[str, Any], **settings: Any) -> Any:
    """``POST /run`` to ``agent``; it may call the body's ``env_url`` unless ``settings`` say."""
    settings.setdefault("allowed_envs", (body["env_url"],))
    app = WorkerApp(agent, Settings(secret=SECRET, **{**QUICK, **settings}))
    try:
        return await asgi_request(app, "POST", "/run", json.dumps(body).encode())
    finally:
        await agent.close_upstreams()  # the lifespan would, at shutdown


@pytest.mark.parametrize(
    ("status", "body", "content_type"),
    [
        ("500 Internal Server Error", LEAK.encode(), "text/plain"),
        ("200 OK", LEAK.encode(), "text/plain"),
        (
            "400 Bad Request",
            json.dumps({"error": {"code": "invalid_request", "message": LEAK}}).encode(),
            "application/json",
        ),
        (
            "400 Bad Request",
            json.dumps({"error": {"code": LEAK, "message": "x"}}).encode(),
            "application/json",
        ),
    ],
    ids=["500-text", "200-text", "json-error-message", "json-error-code"],
)
async def test_no_byte_of_an_upstream_reply_reaches_the_client(
    upstream, status, body, content_type
):
    url = await upstream(_answering(status, body, content_type))
    reply = await _run(CounterAgent(), {"env_url": url, "task": {"increments": [1]}})
    assert reply.status == 502
    assert "SECRET" not in reply.body.decode() and "hunter2" not in reply.body.decode()


async def test_a_reply_without_its_fields_is_bad_upstream_naming_the_field(upstream):
    spaces = json.dumps({"hello": 1}).encode()
    url = await upstream(_answering("200 OK", spaces, "application/json"))
    reply = await _run(CounterAgent(), {"env_url": url, "task": {"increments": [1]}})
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "bad_upstream"
    assert "action_space" in reply.json()["error"]["message"]


async def test_an_upstream_that_never_answers_is_cut_off_by_the_total_timeout(upstream):
    url = await upstream(_silent)
    reply = await asyncio.wait_for(
        _run(CounterAgent(), {"env_url": url, "task": {"increments": [1]}}), timeout=60
    )
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "bad_gateway"


# What the agent may call -------------------------------------------------------------------


class Counted:
    """A loopback server that counts the connections it accepted (and answers ``handler``)."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        await self.handler(reader, writer)


def _closed_port_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


SPACES = json.dumps(
    {"action_space": space_to_json(CounterEnv().action_space), "observation_space": {}}
).encode()


@pytest.fixture
async def probed(upstream) -> tuple[Counted, str]:
    """A local service the probes aim at: it must see no connection."""
    service = Counted(_answering("200 OK", LEAK.encode(), "text/plain"))
    return service, await upstream(service)


@pytest.mark.parametrize(
    "aim",
    [
        lambda url: url,  # the service itself, allowed is another one
        lambda url: url + "/admin",
        lambda url: url + "?x=/admin",
        lambda url: url + "#x",
        lambda url: url.replace("http://", "http://user:pw@"),
        lambda url: url.replace("127.0.0.1", "localhost"),
        lambda url: url.replace("http://", "https://"),
        lambda url: "allowed-name-typo",
        lambda url: "",
    ],
    ids=[
        "other-port",
        "path",
        "query",
        "fragment",
        "userinfo",
        "other-spelling",
        "scheme",
        "unknown-name",
        "empty",
    ],
)
async def test_an_env_url_not_allowed_is_forbidden_target_before_any_connection(
    probed, upstream, aim
):
    service, url = probed
    allowed = Counted(_answering("200 OK", SPACES, "application/json"))
    allowed_url = await upstream(allowed)
    # The probed service is allowed under the other tests' aims (the same host and
    # port, another path or spelling); for "other-port" only the other server is.
    allowed_envs = (f"counter={allowed_url}",) if aim(url) == url else (f"counter={url}",)
    body = {"env_url": aim(url), "task": {"increments": [1]}}
    reply = await _run(CounterAgent(), body, allowed_envs=allowed_envs)
    assert reply.status == 400, reply.body
    assert reply.json()["error"]["code"] == "forbidden_target"
    assert service.connections == 0 and allowed.connections == 0
    assert "hunter2" not in reply.body.decode()


async def test_with_no_allowed_env_every_run_is_forbidden_and_says_which_flag(probed):
    service, url = probed
    body = {"env_url": url, "task": {"increments": [1]}}
    reply = await _run(CounterAgent(), body, allowed_envs=())
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "forbidden_target"
    assert "--allow-env" in reply.json()["error"]["message"]
    assert service.connections == 0


async def test_a_closed_port_and_an_open_one_get_the_same_refusal(probed):
    """No port scanning: a target not allowed is refused the same way, open or closed."""
    _, open_url = probed
    closed_url = _closed_port_url()
    allowed = ("http://127.0.0.1:1",)
    replies = [
        await _run(CounterAgent(), _run_body(u), allowed_envs=allowed)
        for u in (open_url, closed_url)
    ]
    assert [r.status for r in replies] == [400, 400]
    messages = [
        r.json()["error"]["message"].replace(u, "URL")
        for r, u in zip(replies, (open_url, closed_url), strict=True)
    ]
    assert messages[0] == messages[1]


async def test_a_model_url_not_allowed_is_refused_before_the_env_is_called(probed, upstream):
    service, url = probed
    env = Counted(_answering("200 OK", SPACES, "application/json"))
    env_url = await upstream(env)
    body = {"env_url": env_url, "task": {"increments": [1]}, "model": {"base_url": url}}
    reply = await _run(CounterAgent(), body, allowed_envs=(env_url,))
    assert reply.status == 400
    assert reply.json()["error"]["code"] == "forbidden_target"
    assert "--allow-model" in reply.json()["error"]["message"]
    assert env.connections == 0 and service.connections == 0


async def test_the_pool_refuses_a_url_under_no_allowed_upstream(probed, upstream):
    """The backstop for an agent's own code: its pool connects to allowed upstreams only."""
    service, url = probed
    agent = CounterAgent()
    WorkerApp(agent, Settings(secret=SECRET, allowed_envs=("http://127.0.0.1:1/env",), **QUICK))
    client = agent.http_client()
    try:
        for target in (url + "/spaces", "http://127.0.0.1:1/other", "http://127.0.0.1:1/env/../x"):
            with pytest.raises(ForbiddenTargetError):
                await client.get(target)
    finally:
        await client.close()
    assert service.connections == 0


async def test_an_env_pool_is_made_for_allowed_env_servers_only(probed):
    """The env sessions' pools (`AgentServer.env_pool`) have the same backstop."""
    service, url = probed
    agent = CounterAgent()
    allowed = "http://127.0.0.1:1/env"
    WorkerApp(agent, Settings(secret=SECRET, allowed_envs=(allowed,), **QUICK))
    for target in (url, "http://127.0.0.1:1/other", "http://127.0.0.1:1/env/../x"):
        with pytest.raises(ForbiddenTargetError):
            agent.env_pool(target)
    assert agent.env_pool(allowed) is agent.env_pool(allowed)  # one per env server
    await agent.close_upstreams()
    assert service.connections == 0


def _redirecting(location: str) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        head = f"HTTP/1.1 302 Found\r\nlocation: {location}\r\ncontent-length: 0\r\n\r\n"
        writer.write(head.encode())
        await writer.drain()
        writer.close()

    return handle


async def test_a_redirect_is_never_followed(probed, upstream):
    service, url = probed
    env_url = await upstream(_redirecting(url + "/spaces"))
    reply = await _run(CounterAgent(), {"env_url": env_url, "task": {"increments": [1]}})
    assert reply.status == 502
    assert reply.json()["error"]["code"] == "bad_upstream"
    assert "redirect" in reply.json()["error"]["message"]
    assert service.connections == 0


def _large(size: int, chunked: bool) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = b'{"action_space": "' + b"x" * size + b'"}'
        if chunked:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n")
            writer.write(b"transfer-encoding: chunked\r\n\r\n")
            for start in range(0, len(body), 65536):
                part = body[start : start + 65536]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            writer.write(b"0\r\n\r\n")
        else:
            head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            writer.write(head + b"content-length: %d\r\n\r\n" % len(body) + body)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    return handle


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_reply_larger_than_the_limit_is_bad_upstream(upstream, chunked):
    env_url = await upstream(_large(300_000, chunked))
    body = {"env_url": env_url, "task": {"increments": [1]}}
    reply = await _run(CounterAgent(), body, upstream_max_reply_bytes=100_000)
    assert reply.status == 502
    assert reply.json()["error"] == {
        "code": "bad_upstream",
        "message": f"env server {env_url} on /spaces: the reply is larger than 100000 bytes",
    }


async def test_a_model_reply_larger_than_the_limit_is_bad_upstream(upstream):
    env_url = await upstream(_answering("200 OK", SPACES, "application/json"))
    model_url = await upstream(_large(300_000, chunked=True))
    # The env answers /spaces only: the start fails before the model is asked; so
    # the model is asked directly, through the policy the agent would build.
    agent = CounterAgent()
    WorkerApp(
        agent,
        Settings(
            secret=SECRET,
            allowed_envs=(env_url,),
            allowed_models=(f"m={model_url}",),
            upstream_max_reply_bytes=100_000,
            **QUICK,
        ),
    )
    body = {"env_url": env_url, "task": {"increments": [1]}, "model": {"base_url": "m"}}
    agent.check_run(body)
    policy = agent.make_policy(body, json.loads(SPACES))
    try:
        with pytest.raises(BadUpstreamError, match="larger than 100000 bytes"):
            await policy.act(0, {})
    finally:
        await agent.http_client().close()


def test_allowed_targets_are_parsed_at_start_up():
    settings = Settings(
        secret=SECRET,
        allowed_envs=("counter=http://127.0.0.1:8001/", "http://[::1]:9/x"),
        allowed_models=("http://model.internal",),
    )
    envs = settings.env_targets()
    assert envs.resolve("counter") == "http://127.0.0.1:8001"
    assert envs.resolve("http://127.0.0.1:8001/") == "http://127.0.0.1:8001"
    assert envs.resolve("http://[::1]:9/x") == "http://[::1]:9/x"
    assert settings.model_targets().resolve("http://model.internal") == "http://model.internal"
    for bad in (
        "127.0.0.1:8001",
        "ftp://h:1",
        "http://h:1/?q",
        "http://u@h:1",
        "a b=http://h:1",
        "http://h:99999",
    ):
        with pytest.raises(ValueError):
            Settings(secret=SECRET, allowed_envs=(bad,))
    with pytest.raises(ValueError, match="two URLs"):
        Settings(secret=SECRET, allowed_envs=("e=http://h:1", "e=http://h:2"))


async def test_an_honest_run_by_name_and_by_url_scores(serve):
    env = serve("envs.counter:CounterEnv")
    task = {"initial_count": 3, "increments": [1, -2, 5], "expected_count": 7}
    for reference in ("counter", env.url, env.url + "/"):
        reply = await _run(
            CounterAgent(),
            {"env_url": reference, "task": task},
            allowed_envs=(f"counter={env.url}",),
        )
        assert reply.status == 200, reply.body
        assert reply.json()["reward"] == 1.0 and reply.json()["episode_length"] == 3


@pytest.mark.parametrize(
    ("connect", "total"), [(0.0, 10.0), (20.0, 10.0), (5.0, 4000.0)], ids=["zero", "over", "huge"]
)
def test_upstream_timeouts_are_bounded_settings(connect, total):
    with pytest.raises(ValueError, match="upstream"):
        Settings(secret=SECRET, upstream_connect_timeout=connect, upstream_timeout=total)
