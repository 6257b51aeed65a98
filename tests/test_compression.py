"""zstd for binary replies beyond loopback (`gym_sessions.compression`), in process.

A real one-worker `WorkerApp` serves the requests the clients' own HTTP layer
makes (`tests.test_binary_routes.InProcessClient`); the client's host name
decides whether it asks for zstd, as a real client's does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from gym_sessions import compression
from gym_sessions.client.exchange import HTTPClientBase, Request
from gym_sessions.client.protocol import RemoteEnvProtocol
from gym_sessions.errors import HTTPError
from gym_sessions.value_messages import BINARY_ACCEPT
from tests.asgi import asgi_request
from tests.e2e.pixel_envs import FlatFrames, PixelEnv
from tests.test_binary_routes import InProcessClient, started


class Named(InProcessClient):
    """The in-process client under another host name (loopback or not)."""

    def __init__(self, app: Any, url: str, headers: dict[str, str] | None = None) -> None:
        HTTPClientBase.__init__(self, url, headers=headers)
        self.app = app


async def _steps(app: Any, description: Any, client: InProcessClient) -> list[Any]:
    protocol = RemoteEnvProtocol(description)
    observations = [protocol.reset_reply(await client.send(protocol.reset_request(0, None)))[0]]
    for action in (1, 0, 1):
        reply = await client.send(protocol.step_recovery(action).request)
        observations.append(protocol.step_reply(reply)[0])
    return observations


async def _raw_observe(app: Any, cookie: str, accept_encoding: bytes, accept: bytes) -> Any:
    headers = [
        (b"cookie", f"gym_session={cookie}".encode()),
        (b"content-type", b"application/json"),
        (b"accept", accept),
        (b"accept-encoding", accept_encoding),
    ]
    return await asgi_request(app, "POST", "/observe", b"{}", headers)


async def test_a_remote_host_gets_binary_frames_compressed_and_decodes_them_exactly():
    app, description = await started(FlatFrames)
    try:
        remote = InProcessClient(app)  # "in-process": not loopback
        assert remote.exchange(Request("GET", "/spaces")).headers["Accept-Encoding"] == "zstd"
        local = Named(app, "http://127.0.0.1:1")
        assert "Accept-Encoding" not in local.exchange(Request("GET", "/spaces")).headers
        got, want = await _steps(app, description, remote), await _steps(app, description, local)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == np.uint8 and a.flags.writeable
        # On the wire: the frame's 100,800 bytes in about a hundred.
        assert remote.cookie is not None
        packed = await _raw_observe(app, remote.cookie, b"zstd", BINARY_ACCEPT.encode())
        assert packed.headers[b"content-encoding"] == b"zstd"
        assert b"accept-encoding" in packed.headers[b"vary"]
        assert int(packed.headers[b"content-length"]) == len(packed.body) < 2000
        plain = await _raw_observe(app, remote.cookie, b"identity", BINARY_ACCEPT.encode())
        assert b"content-encoding" not in plain.headers and len(plain.body) > 100_800
        assert compression.decompress(packed.body, 1 << 20) == plain.body
    finally:
        await app.shutdown()


async def test_json_and_small_or_incompressible_replies_are_never_compressed():
    app, description = await started(PixelEnv)  # noise frames: zstd would not shrink them
    try:
        client = InProcessClient(app)
        await _steps(app, description, client)
        assert client.cookie is not None
        noise = await _raw_observe(app, client.cookie, b"zstd", BINARY_ACCEPT.encode())
        assert b"content-encoding" not in noise.headers and len(noise.body) > 100_800
        # curl --compressed and MCP see exactly the JSON they always did.
        as_json = await _raw_observe(app, client.cookie, b"zstd, gzip", b"application/json")
        assert b"content-encoding" not in as_json.headers
        assert as_json.json()["episode_length"] == 3
    finally:
        await app.shutdown()
    app, description = await started(lambda: gym.make("CartPole-v1"))
    try:
        client = InProcessClient(app)
        await _steps(app, description, client)
        assert client.cookie is not None
        small = await _raw_observe(app, client.cookie, b"zstd", BINARY_ACCEPT.encode())
        assert b"content-encoding" not in small.headers  # 16 bytes of floats: as they are
    finally:
        await app.shutdown()


async def test_an_accept_encoding_of_the_callers_decides():
    app, description = await started(FlatFrames)
    try:
        off = Named(app, "http://10.0.0.7:8000", headers={"Accept-Encoding": "identity"})
        assert off.exchange(Request("GET", "/spaces")).headers["Accept-Encoding"] == "identity"
        on = Named(app, "http://127.0.0.1:1", headers={"Accept-Encoding": "zstd"})
        for a, b in zip(
            await _steps(app, description, off), await _steps(app, description, on), strict=True
        ):
            np.testing.assert_array_equal(a, b)
    finally:
        await app.shutdown()


@pytest.mark.parametrize(
    ("encoding", "body", "message"),
    [
        ("gzip", b"\x1f\x8b junk", "did not ask for"),
        ("zstd", b"not zstd at all", "not valid zstd"),
        ("zstd", compression.compress(b"x" * 100_000)[:-4], "truncated"),
    ],
    ids=["unasked-encoding", "not-zstd", "truncated-zstd"],
)
def test_a_reply_the_client_cannot_decode_is_an_unexpected_reply(encoding, body, message):
    exchange = HTTPClientBase("http://10.0.0.7:8000").exchange(Request("GET", "/spaces"))
    headers = [("content-type", "application/json"), ("content-encoding", encoding)]
    with pytest.raises(HTTPError, match=message) as raised:
        exchange.replied(200, headers, body)
    assert raised.value.code == "unexpected_reply" and "10.0.0.7" in str(raised.value)


def test_decompression_is_bounded():
    bomb = compression.compress(bytes(64 << 20))  # 64 MiB of zeros in a few kB
    assert len(bomb) < 1 << 16
    with pytest.raises(ValueError, match="more than"):
        compression.decompress(bomb, 1 << 20)


@pytest.mark.parametrize(
    ("header", "accepts"),
    [
        ("zstd", True),
        ("gzip, deflate, br, zstd", True),
        ("ZSTD;q=0.5", True),
        ("zstd;q=0", False),
        ("gzip", False),
        ("zstdx", False),
        (None, False),
    ],
)
def test_accept_encoding_is_read_as_http_says(header, accepts):
    assert compression.accepts_zstd(header) is accepts


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.0.2", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("10.0.0.7", False),
        ("gpu-node-3", False),
        ("::ffff:10.0.0.1", False),
    ],
)
def test_loopback_is_told_from_other_hosts(host, loopback):
    assert compression.is_loopback(host) is loopback


@pytest.mark.skipif(
    sys.version_info >= (3, 14), reason="from 3.14 `compression` is the standard library's"
)
def test_a_users_own_compression_module_is_never_imported_in_its_place(tmp_path):
    # Below Python 3.14 there is no standard `compression` package: a script's
    # compression.py beside it (benchmarks/ had one) must not be taken for it.
    (tmp_path / "compression.py").write_text("raise SystemExit('the user module ran')\n")
    repo = Path(__file__).resolve().parent.parent
    code = (
        "import gym_sessions.client, gym_sessions.compression as c, sys; "
        "print(c.available(), 'compression' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{repo}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]
