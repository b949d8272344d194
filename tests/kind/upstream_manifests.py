"""The Kubernetes e2e suite's own deployment of csi-driver-host-path (storage-csi/hostpath/ in the Go
module cache, at the pinned Kubernetes) with kubeloop's sidecars in it, changed as a user swapping
images would change it, and in no other way that touches a kubeloop sidecar:

- each sidecar kubeloop replaces (provisioner, attacher, resizer, node-driver-registrar,
  livenessprobe) gets kubeloop's image of that name (localstack.sidecar_images) and keeps its args,
  securityContext, mounts and ServiceAccount; the RBAC is upstream's rbac.yaml files, unchanged;
- the driver container runs kubeloop's CSI driver in place of hostpathplugin, under hostpath's name
  (`--drivername=hostpath.csi.k8s.io`), its node-local pool in the manifest's own data directory;
- csi-snapshotter stays upstream's, at the version kubeloop builds (the same image with its binary
  named, as the kind cluster runs it);
- the containers with no image on this offline machine and nothing of kubeloop's to test are left
  out: the external-health-monitor-controller and the snapshot-metadata sidecar (which also needs a
  TLS secret the e2e framework makes)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from localstack.compose import KUBELOOP_IMAGE
from localstack.kind import SNAPSHOTTER_IMAGE
from localstack.sidecar_images import replacement
from tests.support.upstream_rbac import storage_csi

DRIVER = "hostpath.csi.k8s.io"
NAMESPACE = "default"  # where upstream's manifests put everything
STATEFULSET = "csi-hostpathplugin"
LEFT_OUT = ("csi-external-health-monitor-controller", "csi-snapshot-metadata")
# The containers whose image is one of kubeloop's sidecars once swapped.
KUBELOOP_SIDECARS = (
    "node-driver-registrar",
    "liveness-probe",
    "csi-attacher",
    "csi-provisioner",
    "csi-resizer",
)
# Upstream's rbac.yaml of each sidecar the plugin's ServiceAccount is bound to (its RoleBindings and
# ClusterRoleBindings name the roles these files define).
RBAC_FILES = (
    "external-provisioner/rbac.yaml",
    "external-attacher/rbac.yaml",
    "external-resizer/rbac.yaml",
    "external-snapshotter/csi-snapshotter/rbac-csi-snapshotter.yaml",
)
# kubeloop's driver where hostpathplugin was: a node-local pool in the manifest's csi-data-dir.
DRIVER_ARGS = [
    f"--drivername={DRIVER}",
    "--endpoint=$(CSI_ENDPOINT)",
    "--node-id=$(KUBE_NODE_NAME)",
    "--mode=all",
    "--node-local",
    "--pool-dir=/csi-data-dir/pool",
    "--state-dir=/csi-data-dir/state",
    "--capacity=2Gi",
    "-v=4",
]
# How a backing file of this driver shows in the host's `losetup --list`: the path the plugin
# attached it by, inside its container.
POOL_IN_CONTAINER = "/csi-data-dir/pool/"
# The e2e suite's driver file for this deployment (the -storage.testdriver file).
E2E_DRIVER_FILE = (
    Path(__file__).resolve().parents[2] / "tools" / "kind-e2e" / "e2e-driver-upstream-manifests.yaml"
)


def hostpath_dir() -> Path:
    return storage_csi() / "hostpath" / "hostpath"


def rbac_paths() -> list[Path]:
    return [storage_csi() / f for f in RBAC_FILES]


def driver_info() -> Path:
    """Upstream's CSIDriver object for hostpath.csi.k8s.io, applied unchanged."""
    return hostpath_dir() / "csi-hostpath-driverinfo.yaml"


def plugin_documents() -> list[dict[str, Any]]:
    """csi-hostpath-plugin.yaml with the StatefulSet changed as the module docstring says; its
    ServiceAccount and role bindings unchanged."""
    docs = [d for d in yaml.safe_load_all((hostpath_dir() / "csi-hostpath-plugin.yaml").read_text()) if d]
    return [swapped(d) if d["kind"] == "StatefulSet" else d for d in docs]


def swapped(statefulset: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(statefulset)
    spec = out["spec"]["template"]["spec"]
    containers = []
    for c in spec["containers"]:
        if c["name"] in LEFT_OUT:
            continue
        if c["name"] == "hostpath":
            c["image"] = KUBELOOP_IMAGE
            start = 'mkdir -p /csi-data-dir/pool && exec kubeloop-csi-driver "$@"'
            c["command"] = ["sh", "-c", start, "kubeloop-csi-driver"]
            c["args"] = DRIVER_ARGS
        elif c["name"] == "csi-snapshotter":
            c["image"], c["command"] = SNAPSHOTTER_IMAGE, ["/csi-snapshotter"]
        else:
            image = replacement(c["image"])
            assert image is not None, f"kubeloop has no image for container {c['name']} ({c['image']})"
            c["image"] = image
        containers.append(c)
    spec["containers"] = containers
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "csi-snapshot-metadata-server-certs"]
    return out


def changed_fields(original: dict[str, Any], swapped_one: dict[str, Any]) -> dict[str, set[str]]:
    """Per kubeloop sidecar container, the fields that differ between upstream's and ours."""
    by_name = {c["name"]: c for c in swapped_one["spec"]["template"]["spec"]["containers"]}
    changes: dict[str, set[str]] = {}
    for c in original["spec"]["template"]["spec"]["containers"]:
        if c["name"] in KUBELOOP_SIDECARS:
            ours = by_name[c["name"]]
            changes[c["name"]] = {k for k in {*c, *ours} if c.get(k) != ours.get(k)}
    return changes
