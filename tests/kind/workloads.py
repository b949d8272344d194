"""What the kind tests create and read: claims, busybox pods with a claim at /data (their manifests
from localstack/kind_workloads.py), and the volume, VolumeAttachments, mounts and loop devices
behind them. Shared by tests/kind (shared pool) and tests/kind_local (node-local pools)."""

from __future__ import annotations

import json
from typing import Any

from controller_runtime.toolchain import Toolchain
from localstack import kind
from localstack.kind_workloads import SLEEP as SLEEP
from localstack.kind_workloads import claim as claim
from localstack.kind_workloads import pod as pod
from tests.support.waits import eventually

from .conftest import KindCluster

WRITE = (
    "dd if=/dev/urandom of=/data/blob bs=1M count=4 2>/dev/null"
    " && sha256sum /data/blob > /data/blob.sha && sync && sleep 3600"
)
# Exits (the pod never becomes Ready) unless WRITE's blob checks out.
CHECK = "cd /data && sha256sum -c blob.sha && sleep 3600"


def take_snapshot(
    kc: KindCluster, ns: str, name: str, claim_name: str, timeout: float = 120
) -> dict[str, Any]:
    """A VolumeSnapshot (class kubeloop) of the claim; returns its VolumeSnapshotContent once ready."""
    kc.apply(f"""
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {{name: {name}, namespace: {ns}}}
spec:
  volumeSnapshotClassName: kubeloop
  source: {{persistentVolumeClaimName: {claim_name}}}
""")
    eventually(
        f"snapshot {name} to be ready",
        lambda: kc.get("volumesnapshot", "-n", ns, name).get("status", {}),
        timeout,
        0.5,
        satisfied=lambda status: status.get("readyToUse"),
    )
    content = kc.get("volumesnapshot", "-n", ns, name)["status"]["boundVolumeSnapshotContentName"]
    return kc.get("volumesnapshotcontent", content)


def wait_ready(kc: KindCluster, ns: str, name: str, timeout: int = 180) -> None:
    result = kind.run(
        [str(Toolchain.default().binary("kubectl")), f"--kubeconfig={kc.cluster.kubeconfig}", "wait",
         "-n", ns, "--for=condition=Ready", f"pod/{name}", f"--timeout={timeout}s"],
        timeout=timeout + 30, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        described = kc.kubectl("describe", "pod", "-n", ns, name, check=False)
        events = kc.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp", check=False)
        raise AssertionError(f"pod {ns}/{name} not Ready:\n{described[-3000:]}\n{events[-3000:]}")


def volume_of(kc: KindCluster, ns: str, claim_name: str) -> dict[str, Any]:
    name = kc.get("pvc", "-n", ns, claim_name)["spec"]["volumeName"]
    return kc.get("pv", name)


def attachments(kc: KindCluster, pv: str) -> list[dict[str, Any]]:
    return [
        va
        for va in kc.get("volumeattachments")["items"]
        if va["spec"]["source"].get("persistentVolumeName") == pv
    ]


def node_mounts(kc: KindCluster, node: str) -> list[str]:
    return kc.node_exec(node, "findmnt", "-rn", "-o", "TARGET,SOURCE").splitlines()


def host_loops(volume_handle: str) -> list[str]:
    return [line for line in kind.pool_loop_devices() if volume_handle in line]


def data_kib(kc: KindCluster, ns: str, pod_name: str) -> int:
    """The size of the file system at the pod's /data, in KiB (df)."""
    return int(kc.kubectl("exec", "-n", ns, pod_name, "--", "df", "-k", "/data").splitlines()[-1].split()[1])


def grow(kc: KindCluster, ns: str, claim_name: str, size: str, timeout: float = 180) -> None:
    """Asks for `size` and waits until the claim reports it with no resize condition left."""
    request = json.dumps({"spec": {"resources": {"requests": {"storage": size}}}})
    kc.kubectl("patch", "pvc", "-n", ns, claim_name, "-p", request)

    def grown(status: dict[str, Any]) -> bool:
        return status.get("capacity", {}).get("storage") == size and not status.get("conditions")

    eventually(
        f"the claim to report {size} with no resize condition",
        lambda: kc.get("pvc", "-n", ns, claim_name)["status"],
        timeout,
        0.5,
        satisfied=grown,
    )
