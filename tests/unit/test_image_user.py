"""Who kubeloop's image runs as (issue 51). Upstream's sidecar images have no USER, so in upstream's
manifests (the e2e suite's, csi-driver-host-path's) the sidecars are root and open the driver's
root-owned socket; kubeloop's image, swapped in, must do the same: it runs as root by default. So
nothing may lean on the image's user any more: every container of kubeloop's image in kubeloop's own
manifests (deploy/, the Helm chart in both modes) says who it runs as, and in shared mode the
sidecars that need nothing root has (attacher, resizer, livenessprobe) run as 65532 beside a
driver that gives its socket to that group (--socket-group) in a pod whose fsGroup lets them read
their tokens. What stays root says why (docs/sidecar-flags.md, "The image's user")."""

from __future__ import annotations

import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack.compose import KUBELOOP_IMAGE
from tests.support.helm import KUBELOOP, helm_template

NONROOT = 65532
# kubeloop's containers that run as root in its manifests, and why.
ROOT = {
    "kubeloop-plugin": "the driver: loop devices, mounts, the pool's root-owned files",
    "csi-provisioner": "its intent journal is in the root-owned host directory of the driver's state",
    "node-driver-registrar": "it makes its socket in kubelet's root-owned plugins_registry",
    "snapshot-metadata-setup": "shares the provisioner's securityContext (no socket, no host path)",
}
# In shared mode these run as 65532.
NON_ROOT_SIDECARS = {"csi-attacher", "csi-resizer", "liveness-probe"}
# Node-local mode's DaemonSet has no fsGroup and its driver no --socket-group yet: root there.
NODE_LOCAL_ROOT = {"csi-resizer", "liveness-probe"}


def final_stage_user(dockerfile: str) -> str:
    """The user the image's last stage runs as: its last USER, or root without one."""
    user = "root"
    for line in dockerfile.splitlines():
        word = line.strip().split(" ", 1)
        if word[0].upper() == "FROM":
            user = "root"
        elif word[0].upper() == "USER" and len(word) == 2:
            user = word[1].strip()
    return user


def test_the_image_runs_as_root_as_upstreams_sidecar_images_do() -> None:
    user = final_stage_user((REPO_ROOT / "Dockerfile").read_text())
    assert re.fullmatch(r"(root|0)(:(root|0))?", user), f"the image runs as {user}"
    # The non-root user kubeloop's manifests name still exists in it.
    assert "useradd --uid 65532" in (REPO_ROOT / "Dockerfile").read_text()


def pods(docs: list[Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for doc in docs:
        if isinstance(doc, dict) and doc.get("kind") in ("Deployment", "DaemonSet", "StatefulSet"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


@cache
def manifests() -> dict[str, list[Any]]:
    """kubeloop's own manifests: deploy/ (shared mode, node-local mode) and the chart's renderings."""
    out: dict[str, list[Any]] = {}
    for path in [
        *sorted((REPO_ROOT / "deploy" / "kubernetes").glob("*.yaml")),
        REPO_ROOT / "deploy" / "node-local" / "kubeloop.yaml",
    ]:
        out[str(path.relative_to(REPO_ROOT))] = list(yaml.safe_load_all(path.read_text()))
    for values in ([], [KUBELOOP], ["mode=node-local"], [KUBELOOP, "mode=node-local"]):
        out[f"helm {' '.join(values) or 'defaults'}"] = list(
            yaml.safe_load_all(helm_template(*values).stdout)
        )
    return out


def run_as(pod: dict[str, Any], container: dict[str, Any]) -> tuple[Any, Any]:
    pod_sc, sc = pod.get("securityContext") or {}, container.get("securityContext") or {}
    return sc.get("runAsUser", pod_sc.get("runAsUser")), sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))


def kubeloop_image(container: dict[str, Any]) -> bool:
    return (
        bool(re.search(r"(^|/)kubeloop/kubeloop:", container["image"]))
        or container["image"] == KUBELOOP_IMAGE
    )


@pytest.mark.parametrize("source", ["deploy", "helm"])
def test_every_kubeloop_container_says_who_it_runs_as(source: str) -> None:
    """The image's default user decides nothing in kubeloop's own manifests."""
    for where, docs in manifests().items():
        if not where.startswith(source):
            continue
        for workload, pod in pods(docs):
            for c in containers(pod):
                if not kubeloop_image(c):
                    continue
                user, non_root = run_as(pod, c)
                assert user is not None, f"{where}: {workload}/{c['name']} leans on the image's user"
                if user == 0:
                    allowed = set(ROOT) | (NODE_LOCAL_ROOT if "node-local" in where else set())
                    assert c["name"] in allowed, (
                        f"{where}: {workload}/{c['name']} runs as root without a reason"
                    )
                else:
                    assert (user, non_root) == (NONROOT, True), f"{where}: {workload}/{c['name']}"


def shared_mode() -> dict[str, list[Any]]:
    return {w: d for w, d in manifests().items() if "node-local" not in w}


def test_in_shared_mode_the_sidecars_needing_no_root_run_as_65532() -> None:
    for where, docs in shared_mode().items():
        for workload, pod in pods(docs):
            names = {c["name"]: c for c in containers(pod)}
            sidecars = NON_ROOT_SIDECARS & set(names)
            if not sidecars:
                continue
            for name in sidecars:
                c = names[name]
                assert run_as(pod, c) == (NONROOT, True), f"{where}: {workload}/{name}"
                assert (c.get("securityContext") or {}).get("runAsGroup") == NONROOT, (
                    f"{where}: {workload}/{name}"
                )
            # Their driver gives them its socket...
            driver = names["kubeloop-plugin"]
            assert f"--socket-group={NONROOT}" in driver["args"], f"{where}: {workload}"
            # ...and kubelet their tokens (0440 with this group).
            if any(
                m["mountPath"].startswith("/var/run/secrets")
                for n in sidecars
                for m in names[n].get("volumeMounts", [])
            ):
                assert (pod.get("securityContext") or {}).get("fsGroup") == NONROOT, f"{where}: {workload}"
