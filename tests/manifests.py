"""The Kubernetes manifests of ``deploy/kubernetes``, rendered, and their podman equivalent.

`render` gives the resources a Kustomize directory stands for: through
``kubectl kustomize`` where kubectl is installed, else through `load_kustomization`,
which reads the subset of Kustomize these manifests use (resources, namespace,
labels, images, JSON 6902 patches) and which a test holds equal to kubectl's.

`podman_pods` turns the rendered server Deployment and Redis StatefulSet into
the Pods ``podman kube play`` (4.3) runs on one machine's loopback: every pod
on the host network with its own port, the environment the kubelet would
compute written in, and what podman lacks left out (`PODMAN_CHANGES` lists
each change; a test holds every other field equal to the manifests').
"""

from __future__ import annotations

import copy
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "KUBERNETES",
    "PODMAN_CHANGES",
    "args_value",
    "find",
    "load_kustomization",
    "podman_pods",
    "render",
]

KUBERNETES = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
#: The image's VOLUME (deploy/Containerfile): its runtime directory.
IMAGE_VOLUME = "/run/gym-sessions"

Resource = dict[str, Any]

#: What `podman_pods` changes in a pod template, and why.
PODMAN_CHANGES = {
    "hostNetwork": "podman here runs on the host network only (loopback)",
    "restartPolicy": "Never: podman 4.3 restarts a finished init container under Always",
    "terminationGracePeriodSeconds": "not read by podman 4.3; the test stops pods with -t",
    "env": "the values the kubelet computes (status.podIP is refused by podman 4.3)",
    "args": "$(VAR) expanded, --port made the pod's own port",
    "ports": "with hostNetwork podman 4.3 refuses them ('PortMappings can only be used with "
    "Bridge or slirp4netns networking')",
    "livenessProbe": "podman 4.3 runs it with curl from a systemd timer: neither is here",
    "readinessProbe": "not read by podman 4.3; the test polls /ready",
    "lifecycle": "not read by podman 4.3; the test waits the preStop sleep itself",
    "volumes": "the Secret (no Secret kind in podman 4.3) as a host directory; emptyDir "
    "volumes named after their pod (podman 4.3 names one as the manifest does: pods of one "
    "template would share it)",
    "initContainers": "the runtime emptyDir mounted there too: else podman 4.3 makes an "
    "anonymous volume for the image's VOLUME and leaves it behind as it removes the init "
    "container",
    "image": "Redis from Debian's packages (no registry reachable)",
}


def render(directory: Path) -> list[Resource]:
    """The resources the Kustomize ``directory`` renders to."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return load_kustomization(directory)
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], check=True, capture_output=True, text=True
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def load_kustomization(directory: Path) -> list[Resource]:
    """``directory``'s kustomization.yaml applied, with the Kustomize features used here only."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - {"apiVersion", "kind", "resources", "namespace", "labels", "images",
                           "patches"}  # fmt: skip
    if unknown:
        raise ValueError(f"{directory}: Kustomize fields this loader does not read: {unknown}")
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources.extend(load_kustomization(path))
        else:
            resources.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for label in spec.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates"):
            raise ValueError(f"{directory}: labels into selectors or templates are not read")
        for resource in resources:
            resource["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in spec.get("images", []):
        for container in _containers(resources):
            reference = container["image"]
            name = reference.rsplit(":", 1)[0] if ":" in reference.rsplit("/", 1)[-1] else reference
            if name == image["name"]:
                container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    for patch in spec.get("patches", []):
        target = patch["target"]
        for resource in resources:
            if (resource["kind"], resource["metadata"]["name"]) == (target["kind"], target["name"]):
                for op in yaml.safe_load(patch["patch"]):
                    _apply(resource, op)
    if "namespace" in spec:
        for resource in resources:
            resource["metadata"]["namespace"] = spec["namespace"]
    return resources


def _containers(resources: Iterable[Resource]) -> Iterable[dict[str, Any]]:
    for resource in resources:
        pod = resource.get("spec", {}).get("template", {}).get("spec", {})
        yield from pod.get("initContainers", [])
        yield from pod.get("containers", [])


def _apply(document: Any, op: dict[str, Any]) -> None:
    """One JSON patch operation (RFC 6902: add, replace, remove)."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")]
    node = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key: Any = int(last) if isinstance(node, list) and last != "-" else last
    if op["op"] == "remove":
        del node[key]
    elif op["op"] == "replace":
        if key not in (range(len(node)) if isinstance(node, list) else node):
            raise KeyError(f"replace: {op['path']} does not exist")
        node[key] = op["value"]
    elif op["op"] == "add":
        if isinstance(node, list):
            node.insert(len(node) if key == "-" else key, op["value"])
        else:
            node[key] = op["value"]
    else:
        raise ValueError(f"JSON patch operation {op['op']!r} is not read here")


def find(resources: Iterable[Resource], kind: str, name: str | None = None) -> Resource:
    """The one resource of ``kind`` (and ``name``)."""
    (match,) = [r for r in resources if r["kind"] == kind and name in (None, r["metadata"]["name"])]
    return match


def args_value(args: list[str], flag: str) -> str | None:
    """The value of ``--flag=value`` in ``args`` (None without it)."""
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    return values[-1] if values else None


def _env_value(entry: dict[str, Any], config: dict[str, str], container: Resource,
               private_host: str) -> str:  # fmt: skip
    """What the kubelet puts in ``entry``'s variable."""
    if "value" in entry:
        return str(entry["value"])
    source = entry["valueFrom"]
    if "configMapKeyRef" in source:
        return config[source["configMapKeyRef"]["key"]]
    if "fieldRef" in source:
        assert source["fieldRef"]["fieldPath"] == "status.podIP", source
        return private_host
    if "resourceFieldRef" in source:
        ref = source["resourceFieldRef"]
        assert ref["resource"] == "requests.cpu" and str(ref.get("divisor", "1")) == "1", ref
        return str(math.ceil(_cpus(container["resources"]["requests"]["cpu"])))
    raise ValueError(f"environment source not read here: {source}")


def _cpus(quantity: str) -> float:
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def _expand(arg: str, values: dict[str, str]) -> str:
    """``$(NAME)`` in ``arg`` replaced by the variable's value, as the kubelet does."""
    return re.sub(r"\$\((\w+)\)", lambda match: values[match[1]], arg)


def _pod(template: Resource, name: str) -> Resource:
    pod = copy.deepcopy(template)
    spec = pod["spec"]
    spec["hostNetwork"] = True
    spec["restartPolicy"] = "Never"
    spec.pop("terminationGracePeriodSeconds", None)
    for container in spec["containers"]:
        for field in ("ports", "livenessProbe", "readinessProbe", "lifecycle"):
            container.pop(field, None)
    runtime = [m for c in spec["containers"] for m in c.get("volumeMounts", [])
               if m["mountPath"] == IMAGE_VOLUME]  # fmt: skip
    for init in spec.get("initContainers", []):
        mounts = init.setdefault("volumeMounts", [])
        if runtime and not any(m["mountPath"] == IMAGE_VOLUME for m in mounts):
            mounts.append(dict(runtime[0]))
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**pod["metadata"], "name": name},
            "spec": spec}  # fmt: skip


def _own_empty_dirs(pod: Resource) -> None:
    """Name the pod's ``emptyDir`` volumes ``<pod>-<volume>``.

    podman 4.3 makes an ``emptyDir`` a volume named as the manifest names it, so
    every pod of a template would share one: the pod's own name keeps them apart.
    """
    spec, prefix = pod["spec"], pod["metadata"]["name"] + "-"
    names = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    for volume in spec["volumes"]:
        if volume["name"] in names:
            volume["name"] = prefix + volume["name"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        for mount in container.get("volumeMounts", []):
            if mount["name"] in names:
                mount["name"] = prefix + mount["name"]


def podman_pods(
    resources: list[Resource],
    *,
    prefix: str,
    server_ports: Iterable[int],
    redis_port: int,
    secret_dir: str,
    redis_image: str,
) -> tuple[Resource, dict[int, Resource]]:
    """The Redis pod and one server pod per port in ``server_ports``, for ``podman kube play``.

    ``secret_dir`` holds the Secret's keys as files (what the Secret volume
    would show). Pods are named ``<prefix>-redis`` and ``<prefix>-server-<port>``.
    """
    statefulset = find(resources, "StatefulSet", "redis")
    redis = _pod(statefulset["spec"]["template"], f"{prefix}-redis")
    (redis_container,) = redis["spec"]["containers"]
    redis_container["image"] = redis_image
    args = redis_container["args"]
    args[args.index("--port") + 1] = str(redis_port)
    args += ["--bind", "127.0.0.1"]

    deployment = find(resources, "Deployment", "gym-sessions")
    config = dict(find(resources, "ConfigMap", "gym-sessions")["data"])
    config["claims"] = f"redis://127.0.0.1:{redis_port}/0"
    config["peer-network"] = "127.0.0.0/8"
    servers = {}
    for port in server_ports:
        pod = _pod(deployment["spec"]["template"], f"{prefix}-server-{port}")
        (server,) = pod["spec"]["containers"]
        values = {e["name"]: _env_value(e, config, server, "127.0.0.1") for e in server["env"]}
        server["env"] = [{"name": key, "value": value} for key, value in values.items()]
        expanded = [_expand(a, values) for a in server["args"]]
        server["args"] = [f"--port={port}" if a.startswith("--port=") else a for a in expanded]
        for volume in pod["spec"]["volumes"]:
            if "secret" in volume:
                del volume["secret"]
                volume["hostPath"] = {"path": secret_dir, "type": "Directory"}
        _own_empty_dirs(pod)
        servers[port] = pod
    return redis, servers


def write_pod(pod: Resource, directory: str) -> str:
    """``pod`` as a YAML file in ``directory``; its path."""
    path = os.path.join(directory, pod["metadata"]["name"] + ".yaml")
    with open(path, "w") as file:
        yaml.safe_dump(pod, file, sort_keys=False)
    return path
