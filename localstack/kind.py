"""kubeloop in a kind cluster whose kubelets are real: create the cluster from the node image of
tools/build-kind-node.sh, load kubeloop's images, apply deploy/ and wait for every pod to be Ready;
and take it all down again, leaving the host as it was (docs/kind.md).

    python -m localstack.kind up       # build images when needed, create, load, deploy
    python -m localstack.kind up --pools separate   # three workers, each its own pool; the Helm chart
                                                    # in node-local mode (docs/node-local.md)
    python -m localstack.kind up --storage-controllers cluster   # a cluster as users have it: kcm
                                                    # with every default controller, kubelet in
                                                    # /var/lib/k0s/kubelet, the chart's defaults
    python -m localstack.kind down     # delete workloads (volumes cleaned up by kubeloop), delete cluster
    python -m localstack.kind status

`make kind-up` and `make kind-down` run these; tests/kind uses the same class."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from controller_runtime.toolchain import REPO_ROOT, Toolchain, read_versions

from .compose import KUBELOOP_IMAGE
from .sidecar_images import sidecar_images
from .snapshotter import snapshot_crds, snapshot_metadata_crd

CLUSTER_NAME = "kubeloop"
BUSYBOX_IMAGE = "kubeloop/busybox:1.35.0"
# external-snapshotter's snapshot-controller and csi-snapshotter (deploy/kubernetes), and the
# VolumeSnapshot and VolumeGroupSnapshot CRDs tools/build-binaries.sh puts next to them
# (localstack.snapshotter).
SNAPSHOTTER_VERSION = read_versions()["EXTERNAL_SNAPSHOTTER_VERSION"]
SNAPSHOTTER_IMAGE = f"kubeloop/external-snapshotter:{SNAPSHOTTER_VERSION}"
# external-snapshot-metadata's sidecar beside the driver's controller service, and its CRD
# (localstack.snapshotter).
SNAPSHOT_METADATA_VERSION = read_versions()["EXTERNAL_SNAPSHOT_METADATA_VERSION"]
SNAPSHOT_METADATA_IMAGE = f"kubeloop/csi-snapshot-metadata:{SNAPSHOT_METADATA_VERSION}"
CLUSTER_CONFIG = REPO_ROOT / "deploy" / "kind" / "cluster.yaml"
# The host directory every node mounts at /var/lib/kubeloop (deploy/kind/cluster.yaml). With separate
# pools each worker mounts its own directory below it instead, SHARED_DIR/<node name>.
SHARED_DIR = Path("/var/lib/kubeloop-kind")
# Where the nodes see kubeloop's directory (the chart's hostDir) in either layout.
DIR_IN_NODE = "/var/lib/kubeloop"
# The layouts of `up --pools`: one pool every node mounts (deploy/, kubectl apply -k), or three
# workers with a pool each and nothing shared (the Helm chart in node-local mode).
POOLS = ("shared", "separate")
SEPARATE_WORKERS = 3
# The pool size every node offers with separate pools (the chart's capacity value, the driver's
# --capacity): room for the e2e suite's expansion specs (a 1Gi claim grown by 1Gi), small enough
# that tests/kind_local fills a node with one claim (the files are sparse).
SEPARATE_CAPACITY = "4Gi"
# Who runs the storage control plane (the chart's storageControllers): kubeloop (kcm's three storage
# controllers off, as deploy/kind/cluster.yaml has it, kubeloop's deployed) or cluster (a cluster as
# users have it: kcm with every default controller, kubelet under a root directory of its own, and
# the Helm chart with its defaults; docs/kind.md).
STORAGE_CONTROLLERS = ("kubeloop", "cluster")
# kubelet's --root-dir on the nodes of a `cluster` cluster: k0s's, so that nothing kubeloop runs can
# lean on /var/lib/kubelet (the chart's kubeletDir says where it is).
ELSEWHERE_KUBELET_DIR = "/var/lib/k0s/kubelet"
# Where every worker of a separate-pools cluster also sees one directory all of them share, so the
# same cluster can serve the chart in shared mode (hostDir) once the node-local release is gone.
SHARED_DIR_IN_NODE = "/var/lib/kubeloop-shared"
HELM_CHART = REPO_ROOT / "deploy" / "helm" / "kubeloop"
HELM_RELEASE = "kubeloop"
# Which layout the cluster was created with, so a kept cluster of the other layout is recreated.
POOLS_MARK = SHARED_DIR / ".pools"
# How a backing file of the shared pool looks in `losetup --list` on the host: the path the node
# plugin attached it by, inside its node.
POOL_IN_NODE = "/var/lib/kubeloop/pool/"
DEFAULT_KUBECONFIG = REPO_ROOT / ".kubeloop" / "kind" / "kubeconfig"
# kind mounts the host's /lib/modules into each node; docker creates it when the host has none, and
# `down` removes it again when `up` noted so here.
LIB_MODULES = Path("/lib/modules")
MADE_LIB_MODULES = SHARED_DIR / ".made-lib-modules"
# The docker network kind creates for its nodes and leaves behind when a cluster is deleted.
KIND_NETWORK = "kind"
# Workload namespaces are cleaned before the cluster goes, so kubeloop detaches and deletes volumes.
SYSTEM_NAMESPACES = {"kube-system", "kube-public", "kube-node-lease", "default"}


def node_image() -> str:
    return f"kubeloop/kind-node:{read_versions()['KUBERNETES_VERSION']}"


class KindError(RuntimeError):
    pass


def run(
    args: Sequence[str], timeout: float = 300, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT, input=input, check=False
    )
    if check and result.returncode != 0:
        raise KindError(
            f"{' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def say(message: str) -> None:
    print(f"[kind] {message}", file=sys.stderr, flush=True)


def pool_loop_devices() -> list[str]:
    """Loop devices on this host whose backing file is in the kind pool (`NAME BACK-FILE` lines)."""
    out = run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], check=False).stdout
    return sorted(line.strip() for line in out.splitlines() if f" {POOL_IN_NODE}" in line)


def worker_names(cluster: str, count: int) -> list[str]:
    """kind's names for a cluster's workers: <cluster>-worker, <cluster>-worker2, ..."""
    return [f"{cluster}-worker{i if i > 1 else ''}" for i in range(1, count + 1)]


def cluster_config(cluster: str, pools: str, storage_controllers: str) -> dict[str, Any]:
    """deploy/kind/cluster.yaml as the layout asks.

    Separate pools: its nodes replaced by a control plane that mounts nothing of kubeloop's and three
    workers, each mounting its own host directory at /var/lib/kubeloop and one directory all share
    at SHARED_DIR_IN_NODE.

    storage_controllers cluster: without the patch that switches kcm's storage controllers off (so
    kcm runs kubeadm's defaults, every default controller), and with kubelet's --root-dir moved to
    ELSEWHERE_KUBELET_DIR on every node (appended to the kubelet flags kind's kubeadm configuration
    already lists, for the first control plane and for every joining node)."""
    config: dict[str, Any] = yaml.safe_load(CLUSTER_CONFIG.read_text())
    if pools == "separate":
        shared = SHARED_DIR / "shared"
        config["nodes"] = [{"role": "control-plane"}] + [
            {
                "role": "worker",
                "extraMounts": [
                    {"hostPath": str(SHARED_DIR / node), "containerPath": DIR_IN_NODE},
                    {"hostPath": str(shared), "containerPath": SHARED_DIR_IN_NODE},
                ],
            }
            for node in worker_names(cluster, SEPARATE_WORKERS)
        ]
    if storage_controllers == "cluster":
        config["kubeadmConfigPatches"] = [
            patch
            for patch in config["kubeadmConfigPatches"]
            if "controllerManager" not in yaml.safe_load(patch)
        ]
        root_dir = [
            {
                "op": "add",
                "path": "/nodeRegistration/kubeletExtraArgs/-",
                "value": {"name": "root-dir", "value": ELSEWHERE_KUBELET_DIR},
            }
        ]
        config["kubeadmConfigPatchesJSON6902"] = [
            {"group": "kubeadm.k8s.io", "version": "v1beta4", "kind": kind, "patch": yaml.safe_dump(root_dir)}
            for kind in ("InitConfiguration", "JoinConfiguration")
        ]
    return config


@dataclass
class Cluster:
    name: str = CLUSTER_NAME
    kubeconfig: Path = DEFAULT_KUBECONFIG
    pools: str = "shared"
    storage_controllers: str = "kubeloop"
    # With separate pools: the chart's node.embedSidecars (the provisioner and resizer in the
    # plugin's process; the chart's default). A release upgrade, not a new cluster: it is not part
    # of the layout.
    embed_sidecars: bool = True

    def __post_init__(self) -> None:
        if self.pools not in POOLS:
            raise KindError(f"--pools must be one of {', '.join(POOLS)}, not {self.pools!r}")
        if self.storage_controllers not in STORAGE_CONTROLLERS:
            raise KindError(
                f"--storage-controllers must be one of {', '.join(STORAGE_CONTROLLERS)}, "
                f"not {self.storage_controllers!r}"
            )

    @property
    def layout(self) -> str:
        """What `up` recreates a kept cluster for when it differs: pools and control plane."""
        return f"{self.pools}/{self.storage_controllers}"

    @property
    def kubelet_dir(self) -> str:
        return ELSEWHERE_KUBELET_DIR if self.storage_controllers == "cluster" else "/var/lib/kubelet"

    @property
    def separate(self) -> bool:
        return self.pools == "separate"

    def pool_dir(self, node: str) -> Path:
        """The host directory of a worker's pool (separate pools) or of the one pool (shared)."""
        return (SHARED_DIR / node if self.separate else SHARED_DIR) / "pool"

    def kind(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run([str(Toolchain.default().binary("kind")), *args], timeout=timeout, check=check)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        kubectl = str(Toolchain.default().binary("kubectl"))
        return run(
            [kubectl, f"--kubeconfig={self.kubeconfig}", *args], input=input, check=check, timeout=timeout
        ).stdout

    def exists(self) -> bool:
        # An error here (no docker daemon) must not read as "no cluster": down would then skip it.
        return self.name in self.kind("get", "clusters").stdout.split()

    def api_ready(self, timeout: float) -> bool:
        """Whether the API server answers /readyz within timeout seconds. A kept cluster whose node
        containers were restarted (a reboot, a docker restart) resets connections for a while."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.kubectl("get", "--raw", "/readyz", check=False, timeout=15).strip() == "ok":
                    return True
            except subprocess.TimeoutExpired:
                pass
            if time.monotonic() > deadline:
                return False
            time.sleep(2)

    def nodes(self) -> list[str]:
        return self.kind("get", "nodes", "--name", self.name).stdout.split()

    def create(self) -> float:
        """Creates the cluster; returns the seconds it took."""
        SHARED_DIR.mkdir(parents=True, exist_ok=True)
        if not LIB_MODULES.exists():
            LIB_MODULES.mkdir(parents=True)
            MADE_LIB_MODULES.touch()
        self.kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        if self.separate:
            for node in [*worker_names(self.name, SEPARATE_WORKERS), "shared"]:
                # The pool is made beforehand, as an admin mounts a disk there: the node plugin in
                # node-local mode never makes a missing pool.
                self.pool_dir(node).mkdir(parents=True, exist_ok=True)
        config = self.kubeconfig.parent / f"{self.name}-cluster.yaml"
        config.write_text(
            yaml.safe_dump(cluster_config(self.name, self.pools, self.storage_controllers), sort_keys=False)
        )
        POOLS_MARK.write_text(self.layout)
        start = time.monotonic()
        self.kind(
            "create", "cluster", "--name", self.name, "--config", str(config),
            "--image", node_image(), "--kubeconfig", str(self.kubeconfig), "--wait", "180s",
            timeout=600,
        )  # fmt: skip
        return time.monotonic() - start

    def created_layout(self) -> str | None:
        """The layout (`pools/storage controllers`) an existing cluster was created with (None: not
        known, a cluster made before the mark existed)."""
        if not POOLS_MARK.exists():
            return None
        made = POOLS_MARK.read_text().strip()
        return made if "/" in made else f"{made}/kubeloop"  # a mark written before the control plane

    def helm(self, *args: str, timeout: float = 300) -> str:
        helm = str(Toolchain.default().binary("helm"))
        return run([helm, f"--kubeconfig={self.kubeconfig}", *args], timeout=timeout).stdout

    def load_images(self) -> float:
        start = time.monotonic()
        self.kind(
            "load", "docker-image", "--name", self.name, KUBELOOP_IMAGE, BUSYBOX_IMAGE, SNAPSHOTTER_IMAGE,
            SNAPSHOT_METADATA_IMAGE, *sidecar_images(),
            timeout=600,
        )  # fmt: skip
        return time.monotonic() - start

    def deploy(self, timeout: float = 240) -> float:
        """Applies the VolumeSnapshot CRDs, then deploy/, and waits until every kubeloop workload has
        rolled out with Ready pods."""
        start = time.monotonic()
        crds = [f"--filename={c}" for c in (*snapshot_crds(), snapshot_metadata_crd())]
        self.kubectl("apply", *crds)
        self.kubectl("wait", "--for=condition=established", "--timeout=60s", *crds)
        if self.separate or self.storage_controllers == "cluster":
            self.adopt_storage_classes()
            # upgrade --install makes a second `up` on a kept cluster apply what changed.
            self.helm("upgrade", "--install", HELM_RELEASE, str(HELM_CHART), "--namespace", "kube-system",
                      *self.chart_values())  # fmt: skip
        else:
            self.kubectl("apply", "-k", str(REPO_ROOT / "deploy"))
        for workload in self.kubectl(
            "get", "deployments,daemonsets", "-n", "kube-system", "-l", "app.kubernetes.io/name=kubeloop",
            "-o", "name",
        ).split():  # fmt: skip
            self.kubectl(
                "rollout", "status", "-n", "kube-system", workload, f"--timeout={int(timeout)}s",
                timeout=timeout + 30,
            )  # fmt: skip
        return time.monotonic() - start

    def chart_values(self) -> list[str]:
        """The `--set` flags of the chart's release in this layout: the defaults but for what the
        layout itself decides (node-local mode and its pool size with separate pools; kubeloop's
        controllers where kcm's are off; where kubelet is)."""
        values = [f"kubeletDir={self.kubelet_dir}"]
        if self.separate:
            values += ["mode=node-local", f"capacity={SEPARATE_CAPACITY}"]
            values.append(f"node.embedSidecars={str(self.embed_sidecars).lower()}")
        if self.storage_controllers == "kubeloop":
            values.append("storageControllers=kubeloop")
        return [flag for value in values for flag in ("--set", value)]

    def adopt_storage_classes(self) -> None:
        """kind applied deploy/storageclasses.yaml at creation (the node image's default-storage
        manifest, tools/build-kind-node.sh); the release adopts those classes, as Helm adopts objects
        that carry its ownership marks, rather than failing on them."""
        for sc in ("kubeloop", "kubeloop-wffc"):
            if not self.kubectl("get", "storageclass", sc, "--ignore-not-found", "-o", "name").strip():
                continue
            self.kubectl("label", "--overwrite", "storageclass", sc, "app.kubernetes.io/managed-by=Helm")
            self.kubectl(
                "annotate", "--overwrite", "storageclass", sc,
                f"meta.helm.sh/release-name={HELM_RELEASE}", "meta.helm.sh/release-namespace=kube-system",
            )  # fmt: skip

    def clean_workloads(self, timeout: float = 180) -> list[str]:
        """Deletes every pod and claim outside the system namespaces (and in default), then waits for
        kubeloop to delete their volumes. Returns what is still there."""
        try:
            listed = self.kubectl("get", "namespaces", "-o", "name", timeout=60).split()
        except (KindError, subprocess.TimeoutExpired) as e:
            # A cluster whose API server is gone (its docker daemon was stopped) still gets deleted.
            return [f"the API server did not answer, workloads not cleaned up: {str(e).strip()[:300]}"]
        namespaces = [
            ns.split("/", 1)[1] for ns in listed if ns.split("/", 1)[1] not in SYSTEM_NAMESPACES - {"default"}
        ]
        for ns in namespaces:
            self.kubectl("delete", "pods,pvc,volumesnapshots", "--all", "-n", ns, "--wait=false", check=False)
        deadline = time.monotonic() + timeout
        while True:
            left = self.kubectl(
                "get", "pv,volumeattachments,volumesnapshotcontents", "-o", "name", check=False
            ).split()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(1)

    def delete(self) -> None:
        self.kind("delete", "cluster", "--name", self.name, timeout=300)


def up(cluster: Cluster, build: bool = True) -> dict[str, float]:
    figures: dict[str, float] = {}
    if run(["bash", "tools/docker-env.sh", "start"], timeout=180).returncode != 0:
        raise KindError("docker could not be set up")
    if build:
        start = time.monotonic()
        build_env = {**os.environ, "PYTHON": sys.executable}
        result = subprocess.run(
            ["bash", "tools/build-kind-node.sh"], cwd=REPO_ROOT, env=build_env, capture_output=True,
            text=True, timeout=3600, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise KindError(f"tools/build-kind-node.sh failed:\n{result.stderr[-4000:]}")
        figures["build_images_s"] = time.monotonic() - start
    if cluster.exists():
        cluster.kind("export", "kubeconfig", "--name", cluster.name, "--kubeconfig", str(cluster.kubeconfig))
        made = cluster.created_layout() or "shared/kubeloop"
        if made != cluster.layout:
            say(f"cluster {cluster.name} exists as {made}, {cluster.layout} asked for: recreating it")
            cluster.clean_workloads()
            cluster.delete()
        elif cluster.api_ready(timeout=120):
            say(f"cluster {cluster.name} exists: reusing it")
        else:
            say(f"cluster {cluster.name} exists but its API server is not ready after 120 s: recreating it")
            cluster.delete()
    if not cluster.exists():
        say(f"creating cluster {cluster.name} ({node_image()})")
        figures["create_cluster_s"] = cluster.create()
    say("loading images")
    figures["load_images_s"] = cluster.load_images()
    say(
        "applying deploy/"
        if cluster.layout == "shared/kubeloop"
        else f"installing the Helm chart ({cluster.layout})"
    )
    figures["deploy_s"] = cluster.deploy()
    say(f"ready: kubectl --kubeconfig {cluster.kubeconfig} get pods -n kube-system")
    return figures


def down(cluster: Cluster) -> list[str]:
    """Deletes the workloads (so kubeloop unmounts, detaches and deletes their volumes), the cluster and
    the shared directory. Returns what had to be cleaned up by force: it should be nothing."""
    problems: list[str] = []
    run(["bash", "tools/docker-env.sh", "start"], timeout=180)
    if cluster.exists():
        if cluster.kubeconfig.exists():
            left = cluster.clean_workloads()
            if left:
                problems.append(f"still in the cluster after its workloads were deleted: {left}")
        cluster.delete()
    for line in pool_loop_devices():
        problems.append(f"loop device left attached: {line}")
        run(["losetup", "--detach", line.split()[0]], check=False)
    network = run(
        ["docker", "network", "inspect", KIND_NETWORK, "--format", "{{len .Containers}}"], check=False
    )
    if network.returncode == 0 and network.stdout.strip() == "0":
        run(["docker", "network", "rm", KIND_NETWORK], check=False)
    if MADE_LIB_MODULES.exists() and LIB_MODULES.is_dir() and not any(LIB_MODULES.iterdir()):
        LIB_MODULES.rmdir()
    shutil.rmtree(SHARED_DIR, ignore_errors=True)
    return problems


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m localstack.kind",
        description="kubeloop in a kind cluster (deploy/kind/cluster.yaml): up builds the images when "
        "needed, creates the cluster, loads the images and applies deploy/ (or, with --pools separate, "
        "installs the Helm chart in node-local mode); down deletes it all.",
    )
    parser.add_argument("command", choices=["up", "down", "status"])
    parser.add_argument("--name", default=CLUSTER_NAME, help=f"cluster name (default: {CLUSTER_NAME})")
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=DEFAULT_KUBECONFIG,
        help=f"where the kubeconfig goes (default: {DEFAULT_KUBECONFIG})",
    )
    parser.add_argument("--no-build", action="store_true", help="use the images docker has, build nothing")
    parser.add_argument(
        "--pools",
        choices=POOLS,
        default="shared",
        help="up: shared (default: one pool directory every node mounts, deploy/ applied) or separate "
        f"({SEPARATE_WORKERS} workers, each its own pool under {SHARED_DIR}/<node>, the Helm chart in "
        "node-local mode); down removes either",
    )
    parser.add_argument(
        "--storage-controllers",
        choices=STORAGE_CONTROLLERS,
        default="kubeloop",
        help="up: kubeloop (default: kube-controller-manager runs with its three storage controllers "
        "off and kubeloop's are deployed) or cluster (a cluster as users have it: kcm with every "
        f"default controller, kubelet's root directory {ELSEWHERE_KUBELET_DIR}, the Helm chart with "
        "its defaults)",
    )
    args = parser.parse_args(argv)
    cluster = Cluster(args.name, args.kubeconfig, args.pools, args.storage_controllers)
    try:
        if args.command == "up":
            figures = up(cluster, build=not args.no_build)
            say(" ".join(f"{k}={v:.1f}" for k, v in figures.items()))
        elif args.command == "down":
            problems = down(cluster)
            for p in problems:
                say(p)
            sys.exit(1 if problems else 0)
        else:
            if not cluster.exists():
                say(f"no cluster {cluster.name}")
                sys.exit(1)
            print(cluster.kubectl("get", "nodes,pods", "-A", "-o", "wide"))
    except KindError as e:
        say(f"error: {e}")
        sys.exit(1)


if __name__ == "__main__":
    main()
