"""A client pointed at an HTTP server that is not gym-sessions says so, naming the URL.

Against a real loopback ``http.server`` in a thread that answers every request
with one canned page: an HTML 404 (a web server at the wrong URL), a proxy's
HTML 503 and 429, a plain-text 502 and a catch-all HTML 200. Every client
(`RemoteEnv` through ``gymnasium.make``, `AsyncRemoteEnv`, the vector env)
raises the `HTTPError` class of the status, never a class that a
gym-sessions code names (`ClaimsUnavailableError` for any 503), with a message
that names the URL and says the reply is not gym-sessions', never the page.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import gymnasium as gym
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv
from gym_sessions.errors import (
    BadGatewayError,
    ClaimsUnavailableError,
    HTTPError,
    NotFoundError,
    ServiceUnavailableError,
    TooManyRequestsError,
)

NGINX_404 = (
    b"<html>\r\n<head><title>404 Not Found</title></head>\r\n<body>\r\n"
    b"<center><h1>404 Not Found</h1></center>\r\n<hr><center>nginx</center>\r\n"
    b"</body>\r\n</html>\r\n"
)
PROXY_503 = b"<!DOCTYPE html><html><body><h1>503 Service Unavailable</h1>down</body></html>"
PROXY_429 = b"<html><body><h1>429 Too Many Requests</h1></body></html>"
APP_INDEX = b"<!doctype html><html><head><title>My app</title></head><body>Welcome</body></html>"


class CannedServer:
    """An ``http.server`` on 127.0.0.1 answering every GET and POST with one page."""

    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        page = (status, content_type, body)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                self.send_response(page[0])
                self.send_header("Content-Type", page[1])
                self.send_header("Content-Length", str(len(page[2])))
                if page[0] in (429, 503):
                    self.send_header("Retry-After", "7")
                self.end_headers()
                self.wfile.write(page[2])

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def canned() -> Iterator[Callable[[int, str, bytes], CannedServer]]:
    started: list[CannedServer] = []

    def start(status: int, content_type: str, body: bytes) -> CannedServer:
        started.append(CannedServer(status, content_type, body))
        return started[-1]

    yield start
    for server in started:
        server.close()


def _make_sync(url: str) -> None:
    gym.make("gym_sessions/Remote-v0", url=url)


def _make_async(url: str) -> None:
    asyncio.run(AsyncRemoteEnv.create(url))


def _make_vector(url: str) -> None:
    gym.make_vec("gym_sessions/Remote-v0", num_envs=2, url=url)


CLIENTS = {"sync": _make_sync, "async": _make_async, "vector": _make_vector}


def raised(make: Callable[[str], None], url: str) -> HTTPError:
    with pytest.raises(HTTPError) as caught:
        make(url)
    return caught.value


def assert_says_not_gym_sessions(error: HTTPError, url: str) -> None:
    message = str(error)
    assert f"GET /spaces to {url}" in message, message
    assert "not a gym-sessions" in message, message
    assert "<" not in message and "html>" not in message, message  # never the page itself


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_web_servers_html_404_says_the_url_is_not_a_gym_sessions_server(canned, client):
    server = canned(404, "text/html", NGINX_404)
    error = raised(CLIENTS[client], server.url)
    assert type(error) is NotFoundError
    assert (error.status, error.code) == (404, "not_found")
    assert_says_not_gym_sessions(error, server.url)
    assert "with an HTML page titled '404 Not Found'," in str(error)


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_proxys_html_503_is_service_unavailable_not_claims_unavailable(canned, client):
    server = canned(503, "text/html; charset=utf-8", PROXY_503)
    error = raised(CLIENTS[client], server.url)
    assert type(error) is ServiceUnavailableError
    assert not isinstance(error, ClaimsUnavailableError)
    assert (error.status, error.code) == (503, "service_unavailable")
    assert_says_not_gym_sessions(error, server.url)


def test_a_429_is_too_many_requests(canned):
    server = canned(429, "text/html", PROXY_429)
    error = raised(_make_sync, server.url)
    assert type(error) is TooManyRequestsError
    assert (error.status, error.code) == (429, "too_many_requests")
    assert_says_not_gym_sessions(error, server.url)


def test_a_plain_text_error_is_quoted_briefly(canned):
    server = canned(502, "text/plain", b"upstream connect error or disconnect/reset\n" + b"x" * 999)
    error = raised(_make_sync, server.url)
    assert type(error) is BadGatewayError
    assert_says_not_gym_sessions(error, server.url)
    assert "'upstream connect error or disconnect/reset'" in str(error)
    assert "x" * 300 not in str(error)


@pytest.mark.parametrize("client", sorted(CLIENTS))
def test_a_catch_all_html_200_is_an_error_that_says_so(canned, client):
    server = canned(200, "text/html", APP_INDEX)
    error = raised(CLIENTS[client], server.url)
    assert type(error) is HTTPError
    assert (error.status, error.code) == (200, "unexpected_reply")
    assert_says_not_gym_sessions(error, server.url)
