"""kubeloop's node-local mode with real kubelets and the real kube-scheduler (docs/node-local.md):
each volume lives in the pool of the node it was made on and nowhere else, nothing is attached,
pods are placed by each node's free capacity (CSIStorageCapacity), snapshots and expansion stay on
the volume's node, and restores and clones are made on whichever node their pods go to."""

from __future__ import annotations

import json
import time

import pytest

from localstack import kind
from tests.support.waits import consistently, eventually

from ..kind.conftest import KindCluster
from ..kind.workloads import (
    CHECK,
    SLEEP,
    WRITE,
    attachments,
    claim,
    data_kib,
    grow,
    pod,
    take_snapshot,
    wait_ready,
)
from .placement import TOPOLOGY_KEY, WFFC, assert_lives_on, backing_files, delete_and_wait, node_of, pools

DRIVER = "loop.csi.kubeloop.dev"
pytestmark = pytest.mark.root


def test_every_worker_runs_the_whole_driver_and_publishes_its_capacity(local_cluster: KindCluster) -> None:
    kc = local_cluster
    assert kc.get("csidriver", DRIVER)["spec"]["attachRequired"] is False
    assert "kubeloop-csi-controller" not in kc.kubectl(
        "get", "deployments", "-n", "kube-system", "-o", "name"
    )
    pods = kc.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/component=csi-node")["items"]
    assert sorted(p["spec"]["nodeName"] for p in pods) == kc.workers()
    for p in pods:
        assert all(s["ready"] for s in p["status"]["containerStatuses"]), p["metadata"]["name"]
    for worker in kc.workers():
        [driver] = kc.get("csinode", worker)["spec"]["drivers"]
        assert driver["nodeID"] == worker and driver["topologyKeys"] == [TOPOLOGY_KEY]
        labels = kc.get("node", worker)["metadata"]["labels"]
        assert labels[TOPOLOGY_KEY] == worker
    # No pool is shared: each worker's pool directory is a host directory of its own. (The one all
    # workers also see, at SHARED_DIR_IN_NODE, is for the chart in shared mode, test_any_cluster.)
    for worker in kc.workers():
        mounts = json.loads(kind.run(["docker", "inspect", worker, "--format", "{{json .Mounts}}"]).stdout)
        pool = [m["Source"] for m in mounts if m["Destination"] == kind.DIR_IN_NODE]
        assert pool == [str(kind.SHARED_DIR / worker)], mounts

    def capacities() -> dict[str, str]:
        found = kc.get("csistoragecapacities", "-n", "kube-system")["items"]
        return {
            c["nodeTopology"]["matchLabels"][TOPOLOGY_KEY]: c.get("capacity", "")
            for c in found
            if c["storageClassName"] == WFFC
        }

    seen = eventually(
        "a CSIStorageCapacity of kubeloop-wffc per worker",
        capacities,
        120,
        0.5,
        satisfied=lambda by_node: len(by_node) == 3,
    )
    assert sorted(seen) == kc.workers(), seen


def test_wait_for_first_consumer_volume_lives_on_the_scheduled_node_only(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    kc.apply(claim(ns, "data", storage_class=WFFC))
    kc.apply(pod(ns, "writer", "data", None, WRITE))
    wait_ready(kc, ns, "writer")
    node = node_of(kc, ns, "writer")
    assert (
        kc.get("pvc", "-n", ns, "data")["metadata"]["annotations"]["volume.kubernetes.io/selected-node"]
        == node
    )
    pv = assert_lives_on(kc, ns, "data", node)
    eventually(
        "the data written",
        lambda: "blob" in kc.kubectl("exec", "-n", ns, "writer", "--", "cat", "/data/blob.sha"),
        120,
        0.5,
    )
    # A new pod, placed by the scheduler alone, goes where the volume is and reads the data back.
    delete_and_wait(kc, ns, "pod/writer")
    kc.apply(pod(ns, "reader", "data", None, CHECK))
    wait_ready(kc, ns, "reader")
    assert node_of(kc, ns, "reader") == node
    assert attachments(kc, pv["metadata"]["name"]) == []
    delete_and_wait(kc, ns, "pod/reader", "pvc/data")
    handle = pv["spec"]["csi"]["volumeHandle"]
    eventually(
        "the backing file to be deleted", lambda: not any(backing_files(kc, handle).values()), 120, 0.5
    )


def scheduling_messages(kc: KindCluster, ns: str, pod_name: str) -> list[str]:
    events = kc.get("events", "-n", ns, "--field-selector", f"involvedObject.name={pod_name}")["items"]
    return [e["message"] for e in events if e["reason"] == "FailedScheduling"]


def test_scheduler_places_pods_by_each_nodes_free_capacity(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    full = kc.workers()[0]
    # 3584Mi of the 4Gi pool (kind.SEPARATE_CAPACITY) on one node: the 512Mi left there is too small.
    assert kind.SEPARATE_CAPACITY == "4Gi"
    kc.apply(claim(ns, "big", size="3584Mi", storage_class=WFFC))
    kc.apply(pod(ns, "filler", "big", full, SLEEP))
    wait_ready(kc, ns, "filler")
    assert_lives_on(kc, ns, "big", full)

    def reported(node: str) -> str:
        for c in kc.get("csistoragecapacities", "-n", "kube-system")["items"]:
            if c["storageClassName"] == WFFC and c["nodeTopology"]["matchLabels"][TOPOLOGY_KEY] == node:
                return str(c.get("capacity", ""))
        return ""

    eventually(
        f"{full}'s capacity to drop below 400Mi",
        lambda: reported(full),
        120,
        0.5,
        satisfied=lambda capacity: capacity not in ("", "1Gi"),
    )
    for round_ in range(3):
        name = f"fits-{round_}"
        kc.apply(claim(ns, name, size="1Gi", storage_class=WFFC))
        kc.apply(pod(ns, name, name, None, SLEEP))
        wait_ready(kc, ns, name)
        node = node_of(kc, ns, name)
        assert node != full, f"{name} was placed on {full}, whose pool has no room for it"
        assert_lives_on(kc, ns, name, node)
        delete_and_wait(kc, ns, f"pod/{name}", f"pvc/{name}")
    # No node can hold 8Gi: the pod stays Pending with the scheduler's message, and no volume is made.
    kc.apply(claim(ns, "huge", size="8Gi", storage_class=WFFC))
    kc.apply(pod(ns, "waiting", "huge", None, SLEEP))
    messages = eventually(
        "the scheduler's storage capacity message", lambda: scheduling_messages(kc, ns, "waiting"), 90, 0.5
    )
    assert any("did not have enough free storage" in m for m in messages), messages
    consistently(
        "the pod no node has room for Pending",
        lambda: kc.get("pod", "-n", ns, "waiting").get("status", {}).get("phase"),
        5,
        0.5,
        satisfied=lambda phase: phase == "Pending",
    )
    huge = kc.get("pvc", "-n", ns, "huge")
    assert huge["status"]["phase"] == "Pending" and not huge["spec"].get("volumeName")
    assert "selected-node" not in json.dumps(huge["metadata"].get("annotations", {}))


def restore(ns: str, name: str, kind_: str, source: str, size: str = "64Mi") -> str:
    group = "apiGroup: snapshot.storage.k8s.io, " if kind_ == "VolumeSnapshot" else ""
    return claim(ns, name, size, WFFC, data_source=f"{{{group}kind: {kind_}, name: {source}}}")


def test_a_restore_and_a_clone_are_made_on_the_nodes_the_scheduler_puts_their_pods_on(
    local_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = local_cluster, namespace
    kc.apply(claim(ns, "source", storage_class=WFFC))
    kc.apply(pod(ns, "writer", "source", None, WRITE))
    wait_ready(kc, ns, "writer")
    node = node_of(kc, ns, "writer")
    eventually(
        "the data written",
        lambda: "blob" in kc.kubectl("exec", "-n", ns, "writer", "--", "cat", "/data/blob.sha"),
        120,
        0.5,
    )
    kc.kubectl("exec", "-n", ns, "writer", "--", "sync")
    content = take_snapshot(kc, ns, "snap", "source")
    snapshot_handle = content["status"]["snapshotHandle"]
    assert {n: (p / "snapshots" / f"{snapshot_handle}.img").exists() for n, p in pools(kc).items()} == {
        n: n == node for n in kc.workers()
    }
    # Each copy's pod goes to another node than the source's: that node's plugin pulls the source
    # from the source's node (docs/transfer.md), and the copy lives there alone.
    others = [n for n in kc.workers() if n != node]
    kc.apply(restore(ns, "restored", "VolumeSnapshot", "snap"))
    kc.apply(restore(ns, "cloned", "PersistentVolumeClaim", "source"))
    for claim_name, elsewhere in zip(("restored", "cloned"), others, strict=True):
        kc.apply(pod(ns, f"check-{claim_name}", claim_name, elsewhere, CHECK))
    for claim_name, elsewhere in zip(("restored", "cloned"), others, strict=True):
        wait_ready(kc, ns, f"check-{claim_name}")
        assert node_of(kc, ns, f"check-{claim_name}") == elsewhere
        assert_lives_on(kc, ns, claim_name, elsewhere)
    assert not any(
        p.name.endswith((".part", ".progress"))
        for pool in pools(kc).values()
        for p in (pool / "volumes").iterdir()
    )


XFS_WFFC = """
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: kubeloop-test-xfs-wffc}
provisioner: loop.csi.kubeloop.dev
parameters: {csi.storage.k8s.io/fstype: xfs}
reclaimPolicy: Delete
volumeBindingMode: WaitForFirstConsumer
allowVolumeExpansion: true
"""


def test_expansion_of_a_node_local_volume(local_cluster: KindCluster, namespace: str) -> None:
    # xfs grows online with CAP_SYS_ADMIN alone (ext4 also needs CAP_SYS_RESOURCE, which a sandboxed
    # host may lack; tests/kind's expansion test says the same); mkfs.xfs wants 300 MiB at least.
    kc, ns = local_cluster, namespace
    kc.apply(XFS_WFFC)
    try:
        kc.apply(claim(ns, "grow", size="384Mi", storage_class="kubeloop-test-xfs-wffc"))
        kc.apply(pod(ns, "user", "grow", None, SLEEP))
        wait_ready(kc, ns, "user")
        node = node_of(kc, ns, "user")

        before = data_kib(kc, ns, "user")
        start = time.monotonic()
        grow(kc, ns, "grow", "512Mi")
        kc.figures["node_local_expansion_s"] = time.monotonic() - start
        assert data_kib(kc, ns, "user") > before + 100 * 1024
        pv = assert_lives_on(kc, ns, "grow", node)
        handle = pv["spec"]["csi"]["volumeHandle"]
        assert (pools(kc)[node] / "volumes" / f"{handle}.img").stat().st_size == 512 * 1024 * 1024
        delete_and_wait(kc, ns, "pod/user", "pvc/grow")
    finally:
        kc.kubectl("delete", "storageclass", "kubeloop-test-xfs-wffc", check=False)
