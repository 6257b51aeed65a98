"""``https://`` URLs with the usual TLS options, through every client, against a real TLS endpoint.

A TLS-terminating proxy on loopback (`tests.tls.TLSProxy`, certificates made
for the test by a throwaway CA) in front of a real 2-worker server (one for the module): the
blocking env (``gymnasium.make``), the vector env (``make_vec``), the async
env, SB3's vec env and TRL's environment class run episodes over it with
``verify=<CA file>``; the default
(the system's CAs) refuses the throwaway certificate and ``verify=False``
accepts it; a proxy that asks for a client certificate refuses clients
without ``cert=`` and admits ``cert=(certificate, key)`` and a combined PEM
file. Every session closes, the one closed at garbage collection included.
"""

from __future__ import annotations

import asyncio
import gc
import ssl
from collections.abc import Callable, Iterator

import gymnasium as gym
import numpy as np
import pytest

import gym_sessions  # noqa: F401  (registers gym_sessions/Remote-v0)
from gym_sessions.client import AsyncRemoteEnv, RemoteEnv
from gym_sessions.errors import ConnectionLostError, ServerUnreachableError
from gym_sessions.integrations.trl import environment_class
from tests.e2e.test_client_lifecycle import live_sessions
from tests.tls import Certificates, TLSProxy, make_certificates

pytestmark = pytest.mark.e2e

REMOTE = "gym_sessions/Remote-v0"
COUNTER = "envs.counter:CounterEnv"


@pytest.fixture
def certificates(tmp_path) -> Certificates:
    return make_certificates(str(tmp_path))


@pytest.fixture
def tls_proxy(certificates) -> Iterator[Callable[..., TLSProxy]]:
    made: list[TLSProxy] = []

    def make(upstream: str, *, client_certificates: bool = False) -> TLSProxy:
        made.append(TLSProxy(upstream, certificates, client_certificates=client_certificates))
        return made[-1]

    yield make
    for proxy in made:
        proxy.close()


def _sync_episode(url: str, **tls) -> float:
    env = gym.make(REMOTE, url=url, **tls)
    try:
        env.reset(options={"initial_count": 1, "expected_count": 4})
        env.step(3)
        return env.unwrapped.verify()["reward"]
    finally:
        env.close()


def _vector_episode(url: str, **tls) -> float:
    envs = gym.make_vec(REMOTE, num_envs=3, url=url, **tls)
    try:
        observations, _ = envs.reset(options={"initial_count": 2})
        observations, *_ = envs.step(np.array([1, 2, 3]))
        return float(np.all(observations == [3, 4, 5]))
    finally:
        envs.close()


def _async_episode(url: str, **tls) -> float:
    async def main() -> float:
        async with AsyncRemoteEnv(url, **tls) as env:
            await env.reset(options={"initial_count": 1, "expected_count": 3})
            await env.step(2)
            return (await env.verify())["reward"]

    return asyncio.run(main())


def _trl_episode(url: str, **tls) -> float:
    counter = environment_class(url, **tls)
    env = counter()
    try:
        assert env.reset(prompt=[], options={"initial_count": 1, "expected_count": 4}) == "1"
        env.step(3)
        reward = env.get_reward()
        assert reward is not None
        return reward
    finally:
        counter.close_all()


EPISODES = {
    "sync": _sync_episode,
    "vector": _vector_episode,
    "async": _async_episode,
    "trl": _trl_episode,
}


@pytest.mark.parametrize("client", sorted(EPISODES))
def test_every_client_runs_over_https_with_a_ca_file(module_serve, tls_proxy, certificates, client):
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url)
    assert EPISODES[client](proxy.url, verify=certificates.ca) == 1.0
    assert proxy.connections >= 1
    assert live_sessions(server, 2) == 0


@pytest.mark.parametrize("client", sorted(EPISODES))
def test_the_default_refuses_an_untrusted_certificate_and_verify_false_accepts_it(
    module_serve, tls_proxy, client
):
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url)
    with pytest.raises(ServerUnreachableError, match="CERTIFICATE_VERIFY_FAILED") as refused:
        EPISODES[client](proxy.url)
    assert proxy.url in str(refused.value)
    assert EPISODES[client](proxy.url, verify=False) == 1.0
    assert live_sessions(server, 2) == 0


def test_an_ssl_context_of_your_own_goes_as_verify(module_serve, tls_proxy, certificates):
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url)
    context = ssl.create_default_context(cafile=certificates.ca)
    assert _sync_episode(proxy.url, verify=context) == 1.0
    assert _vector_episode(proxy.url, verify=context) == 1.0
    with pytest.raises(ValueError, match="cert="):
        RemoteEnv(proxy.url, verify=context, cert=certificates.client_combined)
    assert live_sessions(server, 2) == 0


@pytest.mark.parametrize("client", sorted(EPISODES))
def test_a_client_certificate_is_sent_where_the_endpoint_asks_for_one(
    module_serve, tls_proxy, certificates, client
):
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url, client_certificates=True)
    # A handshake refused after it ended (TLS 1.3): the first reply never comes.
    with pytest.raises((ConnectionLostError, ServerUnreachableError), match=proxy.url):
        EPISODES[client](proxy.url, verify=certificates.ca)
    assert proxy.connections == 0
    pair = (certificates.client_cert, certificates.client_key)
    assert EPISODES[client](proxy.url, verify=certificates.ca, cert=pair) == 1.0
    combined = certificates.client_combined
    assert EPISODES[client](proxy.url, verify=certificates.ca, cert=combined) == 1.0
    assert live_sessions(server, 2) == 0


def test_an_env_collected_without_close_closes_its_session_over_https(
    module_serve, tls_proxy, certificates
):
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url, client_certificates=True)
    tls = {"verify": certificates.ca, "cert": certificates.client_combined}
    env = RemoteEnv(proxy.url, **tls)
    env.reset()
    envs = gym.make_vec(REMOTE, num_envs=2, url=proxy.url, **tls)
    envs.reset()
    assert live_sessions(server, 2) == 3
    del env, envs
    gc.collect()
    assert live_sessions(server, 2) == 0


def test_sb3_vec_env_takes_the_tls_options(module_serve, tls_proxy, certificates):
    sb3 = pytest.importorskip("gym_sessions.integrations.sb3")
    server = module_serve(COUNTER, workers=2)
    proxy = tls_proxy(server.url)
    venv = sb3.RemoteVecEnv(proxy.url, num_envs=2, verify=certificates.ca)
    try:
        venv.reset()
        venv.step(np.array([1, 1]))
    finally:
        venv.close()
    assert live_sessions(server, 2) == 0
