"""deploy/kubernetes: valid for a current Kubernetes, and consistent with the server it runs."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys

import kubernetes_validate
import pytest

from gym_sessions.metrics import METRICS_PATH
from gym_sessions.server import create_app
from gym_sessions.server.targets import load_target

from .manifests import (
    IMAGE_VOLUME,
    KUBERNETES,
    PODMAN_CHANGES,
    args_value,
    find,
    load_kustomization,
    podman_pods,
)
from .manifests import render as render_kustomization

DIRECTORIES = {"base": KUBERNETES / "base", "example": KUBERNETES / "overlays" / "example"}
#: The Kubernetes version the manifests are validated against (the newest schemas known).
KUBERNETES_VERSION = kubernetes_validate.latest_version()


@pytest.fixture(scope="module", params=sorted(DIRECTORIES))
def rendered(request) -> list[dict]:
    return render_kustomization(DIRECTORIES[request.param])


@pytest.fixture(scope="module")
def serve_help() -> str:
    return subprocess.run(
        [sys.executable, "-m", "gym_sessions", "serve", "--help"],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip


def _server(resources: list[dict]) -> tuple[dict, dict, list[str]]:
    deployment = find(resources, "Deployment", "gym-sessions")
    pod = deployment["spec"]["template"]
    (server,) = pod["spec"]["containers"]
    return pod, server, server["args"]


def test_every_resource_validates_strictly_against_a_current_kubernetes(rendered):
    assert tuple(map(int, KUBERNETES_VERSION.split(".")[:2])) >= (1, 33)
    kinds = set()
    for resource in rendered:
        kubernetes_validate.validate(resource, KUBERNETES_VERSION, strict=True)
        kinds.add(resource["kind"])
    assert kinds == {"ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget",
                     "Service", "StatefulSet"}  # fmt: skip


def test_a_broken_manifest_fails_validation(rendered):
    deployment = copy.deepcopy(find(rendered, "Deployment"))
    (server,) = deployment["spec"]["template"]["spec"]["containers"]
    server["readinessProbe"]["httpGet"]["port"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("name", sorted(DIRECTORIES))
def test_the_fallback_loader_renders_what_kubectl_renders(name):
    def by_name(resources: list[dict]) -> dict:
        return {(r["kind"], r["metadata"]["name"]): r for r in resources}

    kubectl = by_name(render_kustomization(DIRECTORIES[name]))
    assert by_name(load_kustomization(DIRECTORIES[name])) == kubectl


def test_every_flag_is_one_serve_help_lists(rendered, serve_help):
    _, server, args = _server(rendered)
    assert args[0] == "gym_sessions.examples.counter:CounterEnv"
    for arg in args[1:]:
        assert arg.startswith("--"), arg
        assert f" {arg.split('=', 1)[0]} " in serve_help.replace("\n", " "), arg
    # The target loads, and its probe paths are routes it serves.
    served = load_target(args[0])
    create_app(served)  # binds the server to its settings, as a worker does
    paths = {route.path for route in served.routes()} | {METRICS_PATH}
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready" and "/ready" in paths
    assert server["livenessProbe"]["httpGet"]["path"] == "/health" and "/health" in paths
    annotations = find(rendered, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] in paths


def test_ports_workers_and_secrets_agree(rendered):
    pod, server, args = _server(rendered)
    port = int(args_value(args, "--port") or 0)
    (container_port,) = server["ports"]
    assert container_port["containerPort"] == port and container_port["name"] == "http"
    assert server["readinessProbe"]["httpGet"]["port"] in ("http", port)
    assert server["livenessProbe"]["httpGet"]["port"] in ("http", port)
    assert int(pod["metadata"]["annotations"]["prometheus.io/port"]) == port
    assert find(rendered, "Service", "gym-sessions")["spec"]["ports"][0]["targetPort"] == "http"
    # --workers is the CPU request, through the downward API.
    assert args_value(args, "--workers") == "$(WORKERS)"
    (workers,) = [e for e in server["env"] if e["name"] == "WORKERS"]
    ref = workers["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": server["name"], "resource": "requests.cpu", "divisor": "1"}
    # --private-host from the pod IP; claims and peer network from the ConfigMap.
    env = {e["name"]: e["valueFrom"] for e in server["env"]}
    assert args_value(args, "--private-host") == "$(POD_IP)"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    config = find(rendered, "ConfigMap", "gym-sessions")["data"]
    assert args_value(args, "--claims") == "$(CLAIMS)" and config["claims"].startswith("redis://")
    assert args_value(args, "--peer-network") == "$(PEER_NETWORK)"
    # The secret and the metrics token: files copied from the Secret, never env vars.
    (init,) = pod["spec"]["initContainers"]
    mounted = {m["name"]: m["mountPath"] for m in server["volumeMounts"]}
    for flag, key in (("--secret-file", "secret"), ("--metrics-token-file", "metrics-token")):
        assert args_value(args, flag) == f"{mounted['secrets']}/{key}"
        assert f"/secret-source/{key}" in init["command"]
    assert "secretKeyRef" not in str(server["env"])
    assert "--durable-sessions" in args


def test_termination_outlasts_prestop_and_the_servers_own_timeouts(rendered):
    pod, server, args = _server(rendered)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    sleep = server["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert grace > int(sleep[1]) + float(args_value(args, "--graceful-timeout") or 30)
    assert grace > float(args_value(args, "--drain-timeout") or 600)


def test_selectors_reach_the_pods_they_are_for(rendered):
    pod, _, _ = _server(rendered)
    labels = pod["metadata"]["labels"]
    redis_labels = find(rendered, "StatefulSet", "redis")["spec"]["template"]["metadata"]["labels"]
    assert find(rendered, "Service", "gym-sessions")["spec"]["selector"].items() <= labels.items()
    pdb = find(rendered, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]
    assert pdb.items() <= labels.items()
    policy = find(rendered, "NetworkPolicy", "gym-sessions")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    public, private = policy["ingress"]
    assert "from" not in public and public["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert private["from"] == [{"podSelector": {"matchLabels": pdb}}]
    assert private["ports"] == [{"protocol": "TCP", "port": 1024, "endPort": 65535}]
    redis_policy = find(rendered, "NetworkPolicy", "gym-sessions-redis")["spec"]
    assert redis_policy["podSelector"]["matchLabels"].items() <= redis_labels.items()
    assert redis_policy["ingress"][0]["from"] == private["from"]


def test_redis_never_evicts_and_is_where_the_claims_say(rendered):
    redis = find(rendered, "StatefulSet", "redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    service = find(rendered, "Service", "redis")
    claims = find(rendered, "ConfigMap", "gym-sessions")["data"]["claims"]
    assert (
        claims == f"redis://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/0"
    )


def test_the_podman_pods_differ_from_the_manifests_only_where_podman_needs(rendered):
    redis, servers = podman_pods(
        rendered, prefix="t", server_ports=[8101, 8102], redis_port=6400,
        secret_dir="/tmp/s", redis_image="localhost/r",
    )  # fmt: skip
    template = find(rendered, "Deployment")["spec"]["template"]
    for port, pod in servers.items():
        spec = copy.deepcopy(pod["spec"])
        expected = copy.deepcopy(template["spec"])
        assert pod["metadata"]["labels"] == template["metadata"]["labels"]
        (server,), (want,) = spec["containers"], expected["containers"]
        assert args_value(server["args"], "--port") == str(port)
        assert args_value(server["args"], "--claims") == "redis://127.0.0.1:6400/0"
        workers = int(want["resources"]["requests"]["cpu"])
        assert args_value(server["args"], "--workers") == str(workers)
        # emptyDir volumes carry the pod's name (podman would share them between pods).
        for container in [*spec["initContainers"], *spec["containers"]]:
            for mount in container["volumeMounts"]:
                mount["name"] = mount["name"].removeprefix(pod["metadata"]["name"] + "-")
        # The init container: as in the manifests, plus the runtime directory's mount.
        (init,), (want_init,) = spec.pop("initContainers"), expected.pop("initContainers")
        added = [m for m in init["volumeMounts"] if m not in want_init["volumeMounts"]]
        assert added == [m for m in want["volumeMounts"] if m["mountPath"] == IMAGE_VOLUME]
        init["volumeMounts"] = want_init["volumeMounts"]
        assert init == want_init
        for field in PODMAN_CHANGES:
            spec.pop(field, None)
            expected.pop(field, None)
            server.pop(field, None)
            want.pop(field, None)
        assert spec == expected
    assert redis["spec"]["containers"][0]["image"] == "localhost/r"
