"""deploy/kubernetes run for real with ``podman kube play``: Redis and server pods of the image.

The image is built (``make image``; the Debian base is reused from podman's
store), the Kustomize base rendered, and its Redis StatefulSet and server
Deployment turned into Pods podman 4.3 can play on this machine's loopback
(`tests.manifests.podman_pods`: the host network, one port per pod; what else
changes is listed there and held to the manifests by
tests/test_kubernetes_manifests.py). nginx round robin in front stands for the
Service. Every request is on a new connection.

One test, four scenes, to build the image and start Redis once: 200 episodes
over both pods; a pod deleted at once (SIGKILL, as a lost node) with episodes
open; a rolling restart (new pods, then SIGTERM to an old one, as the
Deployment's RollingUpdate does). ``--durable-sessions`` is on in the
manifests, so no episode may be lost in either. Last, the manifests without
it: a pod killed, and exactly its sessions answer 410.
"""

from __future__ import annotations

import asyncio
import copy
import math
import os
import re
import resource
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from envs.counter_load import client_session, make_episodes, play_all
from gym_sessions.routing.redis_claims import RedisClaimStore
from tests.manifests import KUBERNETES, args_value, find, podman_pods, render, write_pod
from tests.services import NginxProcess, free_port, wait_for_registrations

from ..conftest import require_or_skip
from .durable_player import LOST, DurablePlayer

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REDIS_IMAGE = "localhost/gym-sessions-redis:bookworm"
#: What podman needs here besides the repository's containers.conf: kube play
#: sets every container's NOFILE and NPROC limits, to values above the hard
#: limits of this machine unless told (`runc create failed: ... error setting
#: rlimit type 7: operation not permitted`); NPROC above 32768 is refused too.
_NPROC = 8192


#: The names of a container's volumes, from ``podman inspect``.
_VOLUMES = '{{range .Mounts}}{{if eq .Type "volume"}}{{.Name}} {{end}}{{end}}'


class KubePlay:
    """Pods played from YAML files by ``podman kube play``; `close` removes every one."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.played: list[str] = []
        hard_nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        conf = (REPO / "deploy" / "podman" / "containers.conf").read_text()
        limits = (
            f'default_ulimits = ["nofile={hard_nofile}:{hard_nofile}", "nproc={_NPROC}:{_NPROC}"]'
        )
        assert "default_ulimits = []" in conf
        self.conf = directory / "containers.conf"
        self.conf.write_text(conf.replace("default_ulimits = []", limits))

    def podman(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        return subprocess.run(
            ["podman", *args], env=env, check=check, capture_output=True, text=True, timeout=120
        )

    def play(self, pod: dict) -> str:
        name = pod["metadata"]["name"]
        self.played.append(name)
        path = write_pod(pod, str(self.directory))
        result = self.podman("kube", "play", path, check=False)
        assert result.returncode == 0, (result.stderr, self.logs(name))
        return name

    def logs(self, pod: str) -> str:
        containers = self.podman("pod", "inspect", pod, "--format",
                                 "{{range .Containers}}{{.Name}} {{end}}", check=False)  # fmt: skip
        return "\n".join(
            self.podman("logs", "--tail", "30", name, check=False).stderr
            for name in containers.stdout.split()
            if not name.endswith("-infra")
        )

    def remove(self, pod: str, check: bool = True) -> None:
        """``podman pod rm --force --time 0`` (SIGKILL at once, as a lost node), and its volumes.

        ``podman pod rm`` leaves the anonymous volumes behind that podman makes
        for ``emptyDir``; they are removed by name once the pod is gone.
        """
        containers = self.podman("ps", "--all", "--quiet", "--filter", f"pod={pod}", check=False)
        volumes = []
        for container in containers.stdout.split():
            mounts = self.podman("inspect", "--format", _VOLUMES, container, check=False)
            volumes += mounts.stdout.split()
        self.podman("pod", "rm", "--force", "--time", "0", pod, check=check)
        if volumes:
            self.podman("volume", "rm", "--force", *set(volumes), check=False)

    def close(self) -> None:
        for name in self.played:
            self.remove(name, check=False)


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, repr(exc)


def _wait_ready(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (status := _get(f"http://127.0.0.1:{port}/ready")[0]) != 200:
        assert time.monotonic() < deadline, f"pod on port {port} not ready ({status})"
        time.sleep(0.2)


def _metric(port: int, token: str, name: str) -> float:
    """The sum of ``name`` over the pod's workers, from its /metrics (with the token)."""
    status, text = _get(f"http://127.0.0.1:{port}/metrics", token)
    assert status == 200, text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + " ") or line.startswith(name + "{")
    )


#: How a request fails when it met a pod on its way out: reset, a 502 (from nginx,
#: or a hop over a pooled connection to a dead worker), a moment's 503.
WAYS_OUT = (LOST, 502, 503)


def _workers(port: int, token: str) -> set[str]:
    """The ids of the pod's live workers (``gym_sessions_worker_info`` of its /metrics)."""
    status, text = _get(f"http://127.0.0.1:{port}/metrics", token)
    assert status == 200, text
    return set(re.findall(r'^gym_sessions_worker_info\{[^}]*worker="([^"]+)"[^}]*\} 1', text, re.M))


def _holder(redis_url: str, session_id: str) -> str | None:
    """The worker id the session's claim in Redis names."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        value = client.get(RedisClaimStore.key(session_id))
        return None if value is None else value.split("|", 1)[0]
    finally:
        client.close()


async def _observe_after_a_kill(url: str, episodes, cookies) -> dict[str, tuple[int, str | None]]:
    """Each session's ``/observe`` status and error code (read only: sent again while it
    fails as a request meeting a pod on its way out does)."""
    async with client_session() as client:
        player = DurablePlayer(client, url)

        async def observe(cookie: str) -> tuple[int, str | None]:
            for _ in range(PatientPlayer.resends):
                status, data, _ = await player.post("/observe", {}, cookie)
                if status not in WAYS_OUT:
                    break
                await asyncio.sleep(PatientPlayer.resend_delay)
            code = data.get("error", {}).get("code") if isinstance(data, dict) else None
            return status, code

        replies = await asyncio.gather(*[observe(c) for c in cookies])
    return {e.session_id: reply for e, reply in zip(episodes, replies, strict=True)}


class PatientPlayer(DurablePlayer):
    """A `DurablePlayer` that sends ``/verify`` and ``/close_session`` again while they fail.

    Both are safe to resend (a verify followed by a close only reads; a close
    is idempotent), and after a pod's death more than one may fail: each of a
    worker's pooled connections to the dead pod's workers fails once, with a
    502 (the request may have run). While a SIGTERMed pod's workers have left
    Redis but still listen for forwarded requests, its sessions' requests from
    other pods get 503 ``claims_unavailable`` (docs/operating/durable-sessions.md):
    slow, not gone. Nothing else is sent again (a close's 410 means the dead
    worker ran it, and is taken as done, as `DurablePlayer` does).
    """

    resends = 40
    resend_delay = 0.1

    async def _observe(self, cookie: str | None) -> tuple[object, str | None]:
        for _ in range(self.resends):
            status, data, cookie = await self.post("/observe", {}, cookie)
            if status == 200:
                return data, cookie
            assert status in WAYS_OUT, data
            self.observe_resends += 1
            await asyncio.sleep(self.resend_delay)
        raise AssertionError("/observe kept failing")


def _assert_failed_as_on_the_way_out(player: PatientPlayer) -> None:
    """Every failed request failed as one meeting a pod on its way out (never 410 or 409)."""
    odd = {k: f for k, f in player.failures.items() if {s for _, s in f} - set(WAYS_OUT)}
    assert not odd, odd


def _failed(player: PatientPlayer) -> str:
    requests = sum(len(f) for f in player.failures.values())
    return f"{requests} requests of {len(player.failures)} episodes failed and were recovered"


def _renamed(pod: dict, name: str) -> dict:
    return pod | {"metadata": {**pod["metadata"], "name": name}}


async def _scene(
    url: str, player_class: type[DurablePlayer], seed: int, fault, held: int = 0
) -> tuple:
    """80 episodes through ``url``, ``fault`` a third of the way; the player and how many scored.

    ``held`` of them start before and finish only after the fault, so their
    sessions are open, and idle, across it.
    """
    async with client_session() as client:
        player = player_class(client, url)
        episodes = make_episodes(80, seed=seed)
        waiting, moving = episodes[:held], episodes[held:]
        cookies = await asyncio.gather(*[player.start(e) for e in waiting])
        await _play_with(player, moving, fault, 1 / 3)
        await asyncio.gather(*[player.finish(e, c) for e, c in zip(waiting, cookies, strict=True)])
    return player, [e.reward for e in episodes].count(1.0)


async def _play_with(player: DurablePlayer, episodes, fault, at: float) -> None:
    """Play ``episodes``; ``fault`` (blocking, in a thread) once ``at`` of the steps are done."""
    cookies = await asyncio.gather(*[player.start(e) for e in episodes])
    total = sum(len(e.increments) for e in episodes)

    async def inject() -> None:
        while player.steps_done < total * at:  # noqa: ASYNC110 (a count, not an event)
            await asyncio.sleep(0.005)
        await asyncio.to_thread(fault)
        player.killed = True

    await asyncio.gather(
        inject(), *[player.finish(e, c) for e, c in zip(episodes, cookies, strict=True)]
    )


@pytest.fixture(scope="module")
def images() -> None:
    for program, package in (("podman", "podman"), ("runc", "runc"),
                             ("mmdebstrap", "mmdebstrap"), ("catatonit", "catatonit")):  # fmt: skip
        require_or_skip(program, package)
    if os.geteuid() != 0:
        pytest.skip("podman runs rootful here (runc, no user namespaces)")
    venv = sys.prefix  # the venv running the tests builds the wheel; never reinstalled
    built = subprocess.run(
        ["make", "-C", str(REPO), "image", "redis-image", f"VENV={venv}",
         "-o", f"{venv}/.installed"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, (built.stdout[-3000:], built.stderr[-3000:])


@pytest.mark.timeout(600)
def test_the_manifests_under_podman_kube_play_lose_no_episode(images, tmp_path):
    resources = render(KUBERNETES / "base")
    deployment = find(resources, "Deployment", "gym-sessions")
    template = deployment["spec"]["template"]
    grace = template["spec"]["terminationGracePeriodSeconds"]
    (server,) = template["spec"]["containers"]
    workers = math.ceil(float(server["resources"]["requests"]["cpu"]))
    assert "--durable-sessions" in server["args"]

    # The Secret's keys as the kubelet shows them with fsGroup: root's, group-readable.
    secret_dir = tmp_path / "secret"
    secret_dir.mkdir()
    keys = {"secret": secrets.token_hex(32), "metrics-token": secrets.token_hex(32)}
    for key, value in keys.items():
        path = secret_dir / key
        path.write_text(value + "\n")
        os.chown(path, 0, template["spec"]["securityContext"]["fsGroup"])
        path.chmod(0o440)

    ports = [free_port() for _ in range(3)]
    redis_port = free_port()
    redis, servers = podman_pods(
        resources, prefix=f"gs-kube-{os.getpid()}", server_ports=ports, redis_port=redis_port,
        secret_dir=str(secret_dir), redis_image=REDIS_IMAGE,
    )  # fmt: skip
    redis_url = args_value(servers[ports[0]]["spec"]["containers"][0]["args"], "--claims")
    assert redis_url is not None
    pods = KubePlay(tmp_path)
    # As a Service: no pod is ever taken out for a failed request (a refused
    # connection still goes on to the next pod).
    nginx = NginxProcess([f"http://127.0.0.1:{p}" for p in ports], server_options="max_fails=0")
    try:
        started = time.monotonic()
        pods.play(redis)
        for port in ports[:2]:
            pods.play(servers[port])
        for port in ports[:2]:
            _wait_ready(port)
        wait_for_registrations(redis_url, 2 * workers)
        nginx.start()
        print(f"\nRedis and 2 server pods ready in {time.monotonic() - started:.1f} s")

        # 1. 200 episodes over both pods.
        episodes = asyncio.run(play_all(nginx.url, make_episodes(200, seed=30)))
        assert [e.reward for e in episodes].count(1.0) == 200, [
            e.error_codes for e in episodes if e.reward != 1.0
        ][:5]
        assert all(status == 200 for e in episodes for status in e.statuses)
        token = keys["metrics-token"]
        held = {p: _metric(p, token, "gym_sessions_snapshots_written_total") for p in ports[:2]}
        assert all(held.values()), held  # both pods held sessions

        # 2. A pod deleted at once (SIGKILL, as with a lost node): its open
        # sessions continue on the other pod. 20 are held open across the
        # deletion, so some are surely there when it lands (podman takes
        # seconds to delete a pod: once, every other episode had ended).
        deleted = servers[ports[0]]["metadata"]["name"]
        scene = time.monotonic()
        player, scored = asyncio.run(
            _scene(nginx.url, PatientPlayer, 31, lambda: pods.remove(deleted), held=20)
        )
        assert scored == 80, player.failures
        _assert_failed_as_on_the_way_out(player)
        restored = _metric(ports[1], token, "gym_sessions_restored_sessions_total")
        print(f"pod deleted: 80 of 80 scored 1.0; {restored:.0f} sessions restored on the "
              f"other pod; {_failed(player)}; {time.monotonic() - scene:.1f} s")  # fmt: skip
        assert restored > 0

        # 3. Rolling restart, as RollingUpdate (maxSurge 1) does it: the replacement
        # of the deleted pod and a new pod ready first, then SIGTERM to the old
        # one mid-episodes, with the manifests' grace period.
        pods.play(_renamed(servers[ports[0]], deleted + "-b"))
        pods.play(servers[ports[2]])
        for port in (ports[0], ports[2]):
            _wait_ready(port)
        wait_for_registrations(redis_url, 3 * workers)
        stopped = servers[ports[1]]["metadata"]["name"]
        stop_seconds: list[float] = []

        def sigterm() -> None:
            begun = time.monotonic()
            pods.podman("pod", "stop", "--time", str(grace), stopped)
            stop_seconds.append(time.monotonic() - begun)

        scene = time.monotonic()
        # Half the episodes step through the stop; half are open and idle across it,
        # so those the old pod held must be restored on the others.
        rolling, scored = asyncio.run(_scene(nginx.url, PatientPlayer, 32, sigterm, held=40))
        assert scored == 80, rolling.failures
        _assert_failed_as_on_the_way_out(rolling)
        restored = sum(
            _metric(p, token, "gym_sessions_restored_sessions_total") for p in (ports[0], ports[2])
        )
        took = time.monotonic() - scene
        print(f"rolling restart: 80 of 80 scored 1.0; SIGTERM to exit {stop_seconds[0]:.1f} s; "
              f"{restored:.0f} sessions restored on the other pods; {_failed(rolling)}; "
              f"{took:.1f} s")  # fmt: skip
        state = pods.podman("pod", "inspect", stopped, "--format", "{{.State}}").stdout.strip()
        assert state == "Exited", state
        assert stop_seconds[0] < grace, "the pod needed SIGKILL"
        assert restored > 0

        # 4. Without --durable-sessions (the manifests with the flag taken out), a
        # pod killed with sessions open: exactly its sessions answer 410.
        for name in (deleted + "-b", servers[ports[2]]["metadata"]["name"]):
            pods.remove(name)
        plain = copy.deepcopy(resources)
        find(plain, "Deployment", "gym-sessions")["spec"]["template"]["spec"]["containers"][0][
            "args"
        ].remove("--durable-sessions")
        _, plain_servers = podman_pods(
            plain, prefix=f"gs-kube-{os.getpid()}-plain", server_ports=ports[:2],
            redis_port=redis_port, secret_dir=str(secret_dir), redis_image=REDIS_IMAGE,
        )  # fmt: skip
        for port in ports[:2]:
            pods.play(plain_servers[port])
        for port in ports[:2]:
            _wait_ready(port)
        killed = _workers(ports[0], token)
        assert killed and not killed & _workers(ports[1], token)

        async def start_all(episodes) -> list[str]:
            async with client_session() as client:
                starter = PatientPlayer(client, nginx.url)
                return await asyncio.gather(*[starter.start(e) for e in episodes])

        episodes = make_episodes(40, seed=33)
        cookies = asyncio.run(start_all(episodes))
        gone = {e.session_id for e in episodes if _holder(redis_url, e.session_id) in killed}
        pods.remove(plain_servers[ports[0]]["metadata"]["name"])
        replies = asyncio.run(_observe_after_a_kill(nginx.url, episodes, cookies))
        assert 0 < len(gone) < 40
        assert {s for s, r in replies.items() if r == (410, "session_gone")} == gone, replies
        assert all(r[0] == 200 for s, r in replies.items() if s not in gone), replies
        print(f"without --durable-sessions, a pod killed: its {len(gone)} sessions of 40 "
              f"answer 410 session_gone, the other {40 - len(gone)} 200")  # fmt: skip
    except BaseException:
        for name in pods.played:
            print(f"--- {name}\n{pods.logs(name)}")
        print(f"--- nginx\n{nginx.log()}")
        raise
    finally:
        nginx.close()
        pods.close()
