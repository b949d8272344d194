"""deploy/ and deploy/kind/cluster.yaml agree with the code they deploy: every container runs a console
script kubeloop installs, with flags that script accepts, from the image tools/build-images.sh builds;
kustomization.yaml lists every manifest; the kind cluster asks for the etcd image the node image has."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller_runtime.toolchain import REPO_ROOT
from localstack import kind
from localstack.compose import KUBELOOP_IMAGE, images
from localstack.kind import SNAPSHOT_METADATA_IMAGE, SNAPSHOTTER_IMAGE
from tests.support.container_args import expand

DEPLOY = REPO_ROOT / "deploy"


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def containers() -> list[tuple[str, dict[str, Any]]]:
    """Every container, init containers included, of both modes: deploy/kubernetes (shared) and
    deploy/node-local (the Helm chart's node-local rendering), the latter named
    node-local:<workload>/<container>."""
    out = []
    paths = [("", p) for p in sorted((DEPLOY / "kubernetes").glob("*.yaml"))]
    paths.append(("node-local:", DEPLOY / "node-local" / "kubeloop.yaml"))
    for prefix, path in paths:
        for doc in documents(path):
            if doc["kind"] in ("Deployment", "DaemonSet"):
                pod = doc["spec"]["template"]["spec"]
                for c in [*pod.get("initContainers", []), *pod["containers"]]:
                    out.append((f"{prefix}{doc['metadata']['name']}/{c['name']}", c))
    return out


@cache
def scripts() -> dict[str, str]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return dict(project["scripts"])


@cache
def help_text(script: str) -> str:
    module = scripts()[script].split(":")[0]
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    return result.stdout


def test_kustomization_lists_every_manifest_but_the_local_stacks_kubelet() -> None:
    listed = set(yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["resources"])
    present = {str(p.relative_to(DEPLOY)) for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml"}
    present |= {str(p.relative_to(DEPLOY)) for p in (DEPLOY / "rbac").glob("*.yaml")}
    present |= {str(p.relative_to(DEPLOY)) for p in (DEPLOY / "kubernetes").glob("*.yaml")}
    # node-agent.yaml is the local stack's kubelet; csi-node-transfers.yaml, node-deployment.yaml and
    # node-finalizer.yaml are node-local mode's (deploy/node-local, rendered from the Helm chart).
    assert listed == present - {
        "rbac/node-agent.yaml",
        "rbac/csi-node-transfers.yaml",
        "rbac/node-deployment.yaml",
        "rbac/node-finalizer.yaml",
    }


def kubeloop_containers() -> list[tuple[str, dict[str, Any]]]:
    """All but upstream's Go sidecars (test_snapshot_containers_run_the_image_...)."""
    return [(n, c) for n, c in containers() if c["image"] not in (SNAPSHOTTER_IMAGE, SNAPSHOT_METADATA_IMAGE)]


@pytest.mark.parametrize("name,container", kubeloop_containers(), ids=[n for n, _ in kubeloop_containers()])
def test_every_container_runs_a_kubeloop_script_with_flags_it_accepts(
    name: str, container: dict[str, Any]
) -> None:
    assert container["image"] == KUBELOOP_IMAGE
    [script] = container["command"]
    assert script in scripts(), f"{name}: {script} is not a console script of pyproject.toml"
    if script == "kubeloop-node-plugin":
        # Sections of components, each checked by that component's own parser.
        from node_plugin.main import parse

        env = {e["name"]: "x" for e in container.get("env", [])}
        args = [expand(a, env) for a in container["args"]]
        _, parts = parse(args)
        assert len(parts) == 3, name
        return
    usage = help_text(script)
    for arg in container.get("args", []):
        flag = arg.split("=", 1)[0]
        assert flag.startswith("-") and flag in usage, f"{name}: {script} has no flag {flag}"


def test_sidecars_of_one_pod_listen_on_different_ports() -> None:
    by_pod: dict[str, list[str]] = {}
    for name, container in containers():
        for arg in container.get("args", []):
            if arg.startswith("--http-endpoint="):
                by_pod.setdefault(name.split("/")[0], []).append(arg.split(":")[-1])
    for pod, ports in by_pod.items():
        assert len(ports) == len(set(ports)), (pod, ports)


def cluster_configuration(config: dict[str, Any]) -> dict[str, Any]:
    """The kubeadm ClusterConfiguration patches of a kind config, merged."""
    merged: dict[str, Any] = {}
    for patch in config["kubeadmConfigPatches"]:
        loaded = yaml.safe_load(patch)
        if loaded["kind"] == "ClusterConfiguration":
            merged.update(loaded)
    return merged


@pytest.mark.parametrize("pools", kind.POOLS)
def test_kind_cluster_asks_for_the_etcd_image_the_node_image_has(pools: str) -> None:
    for storage_controllers in kind.STORAGE_CONTROLLERS:
        config = cluster_configuration(kind.cluster_config("kubeloop", pools, storage_controllers))
        assert images()["etcd"].rsplit(":", 1)[1] == config["etcd"]["local"]["imageTag"]


def test_kind_cluster_layouts_say_who_runs_the_storage_controllers() -> None:
    ours = kind.cluster_config("kubeloop", "shared", "kubeloop")
    assert ours == yaml.safe_load((DEPLOY / "kind" / "cluster.yaml").read_text())
    controllers = cluster_configuration(ours)["controllerManager"]["extraArgs"][0]["value"].split(",")
    for off in ("persistentvolume-binder", "persistentvolume-attach-detach", "persistentvolume-expander"):
        assert f"-{off}-controller" in controllers
    assert "kubeadmConfigPatchesJSON6902" not in ours
    # A cluster as users have it: kubeadm's own kcm flags, kubelet's root directory elsewhere on every
    # node (the first control plane's InitConfiguration, every other node's JoinConfiguration).
    theirs = kind.cluster_config("kubeloop", "separate", "cluster")
    assert "controllerManager" not in cluster_configuration(theirs)
    root_dir = {"name": "root-dir", "value": kind.ELSEWHERE_KUBELET_DIR}
    patched = {p["kind"]: yaml.safe_load(p["patch"]) for p in theirs["kubeadmConfigPatchesJSON6902"]}
    expected = [{"op": "add", "path": "/nodeRegistration/kubeletExtraArgs/-", "value": root_dir}]
    assert patched == {"InitConfiguration": expected, "JoinConfiguration": expected}
    assert [n["role"] for n in theirs["nodes"]] == ["control-plane", "worker", "worker", "worker"]


def test_snapshot_containers_run_the_image_of_the_pinned_external_snapshotter() -> None:
    found = {name: c for name, c in containers() if c["image"] == SNAPSHOTTER_IMAGE}
    assert set(found) == {
        "kubeloop-snapshot-controller/snapshot-controller",
        "kubeloop-csi-controller/csi-snapshotter",
        "node-local:kubeloop-snapshot-controller/snapshot-controller",
        "node-local:kubeloop-csi-node/csi-snapshotter",
    }
    for name, container in found.items():
        assert container["command"] == [f"/{name.split('/')[-1]}"], name


def test_snapshot_metadata_sidecar_runs_the_pinned_image_on_the_certificate_its_init_container_made() -> None:
    found = {name: c for name, c in containers() if c["image"] == SNAPSHOT_METADATA_IMAGE}
    assert set(found) == {"kubeloop-csi-controller/csi-snapshot-metadata"}
    [sidecar] = found.values()
    assert sidecar["command"] == ["/csi-snapshot-metadata"]
    by_name = dict(containers())
    setup = by_name["kubeloop-csi-controller/snapshot-metadata-setup"]
    cert_dir = next(a.split("=", 1)[1] for a in setup["args"] if a.startswith("--cert-dir="))
    assert f"--tls-cert={cert_dir}/tls.crt" in sidecar["args"]
    assert f"--tls-key={cert_dir}/tls.key" in sidecar["args"]
    # The address the SnapshotMetadataService names is the Service in front of the sidecar's port.
    address = next(a.split("=", 1)[1] for a in setup["args"] if a.startswith("--address="))
    [service] = documents(DEPLOY / "kubernetes" / "snapshot-metadata.yaml")
    name_ns, port = address.rsplit(":", 1)
    assert name_ns == f"{service['metadata']['name']}.{service['metadata']['namespace']}"
    [svc_port] = service["spec"]["ports"]
    assert svc_port["port"] == int(port)
    assert {"containerPort": svc_port["targetPort"], "name": "snapshot-meta"} in sidecar["ports"]
