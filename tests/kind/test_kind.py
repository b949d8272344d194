"""kubeloop as a CSI driver in kind: the real kube-scheduler, kube-controller-manager (its storage
controllers off) and kubelet, and kubeloop's controllers, sidecars and node plugin from deploy/."""

from __future__ import annotations

import time
from typing import Any

import pytest

from localstack import kind
from tests.support.waits import consistently, eventually

from .conftest import KindCluster
from .workloads import (
    SLEEP,
    WRITE,
    attachments,
    claim,
    data_kib,
    grow,
    host_loops,
    node_mounts,
    pod,
    volume_of,
    wait_ready,
)

DRIVER = "loop.csi.kubeloop.dev"
ATTACHER_FINALIZER = "external-attacher/loop-csi-kubeloop-dev"
pytestmark = pytest.mark.root


def test_every_kubeloop_pod_is_ready_and_registered(kind_cluster: KindCluster) -> None:
    pods = kind_cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=kubeloop")["items"]
    by_component: dict[str, list[dict[str, Any]]] = {}
    for p in pods:
        by_component.setdefault(p["metadata"]["labels"]["app.kubernetes.io/component"], []).append(p)
    assert sorted(by_component) == [
        "attach-detach-controller", "csi-controller", "csi-node", "pv-controller", "snapshot-controller",
        "volume-expand-controller",
    ]  # fmt: skip
    assert len(by_component["csi-node"]) == len(kind_cluster.workers())
    for p in pods:
        statuses = p["status"]["containerStatuses"]
        assert all(s["ready"] for s in statuses), (p["metadata"]["name"], statuses)
    controller = by_component["csi-controller"][0]
    assert {c["name"] for c in controller["spec"]["containers"]} == {
        "kubeloop-plugin", "csi-provisioner", "csi-attacher", "csi-resizer", "csi-snapshotter",
        "csi-snapshot-metadata", "liveness-probe",
    }  # fmt: skip
    # The real kubelet registered the node plugin through the registrar's socket.
    for worker in kind_cluster.workers():
        drivers = kind_cluster.get("csinode", worker)["spec"]["drivers"] or []
        assert [d["name"] for d in drivers] == [DRIVER], worker
        assert drivers[0]["nodeID"] == worker
    # kube-controller-manager leaves the three storage controllers to kubeloop.
    kcm = kind_cluster.get("pod", "-n", "kube-system", "kube-controller-manager-kubeloop-control-plane")
    command = " ".join(kcm["spec"]["containers"][0]["command"])
    for off in ("persistentvolume-binder", "persistentvolume-attach-detach", "persistentvolume-expander"):
        assert f"-{off}-controller" in command


def test_volume_follows_its_pod_across_nodes_then_is_deleted(
    kind_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = kind_cluster, namespace
    first, second = kc.workers()
    start = time.monotonic()
    kc.apply(claim(ns, "data") + "---" + pod(ns, "writer", "data", first, WRITE))
    wait_ready(kc, ns, "writer")
    kc.figures["pvc_to_running_pod_s"] = time.monotonic() - start

    pv = volume_of(kc, ns, "data")
    name, handle = pv["metadata"]["name"], pv["spec"]["csi"]["volumeHandle"]
    assert pv["spec"]["csi"]["driver"] == DRIVER
    assert (kind.SHARED_DIR / "pool" / "volumes" / f"{handle}.img").exists()
    # Attached by kubeloop's attach-detach controller (kcm's is off) and external-attacher.
    [va] = attachments(kc, name)
    assert va["spec"]["nodeName"] == first and va["status"]["attached"] is True
    assert ATTACHER_FINALIZER in va["metadata"]["finalizers"]
    # Staged and published by the real kubelet through the node plugin.
    mounts = node_mounts(kc, first)
    assert any(f"/volumes/kubernetes.io~csi/{name}/mount" in m for m in mounts), mounts
    assert any(f"/plugins/kubernetes.io/csi/{DRIVER}/" in m and "globalmount" in m for m in mounts), mounts
    assert len(host_loops(handle)) == 1
    kc.kubectl("exec", "-n", ns, "writer", "--", "sha256sum", "-c", "/data/blob.sha")

    # The pod moves to the other worker: kubelet unmounts, kubeloop detaches and attaches there.
    kc.kubectl("delete", "pod", "-n", ns, "writer", "--wait=true", "--timeout=120s", timeout=150)
    kc.apply(pod(ns, "reader", "data", second, SLEEP))
    wait_ready(kc, ns, "reader")
    kc.kubectl("exec", "-n", ns, "reader", "--", "sha256sum", "-c", "/data/blob.sha")
    eventually(
        "the attachment to the first node to go",
        lambda: [va["spec"]["nodeName"] for va in attachments(kc, name)],
        120,
        0.5,
        satisfied=lambda nodes: nodes == [second],
    )
    assert not [m for m in node_mounts(kc, first) if name in m or f"/csi/{DRIVER}/" in m]
    assert len(host_loops(handle)) == 1

    # Delete: unmounted, detached, the PV and its backing file gone.
    kc.kubectl("delete", "pod", "-n", ns, "reader", "--wait=true", "--timeout=120s", timeout=150)
    kc.kubectl("delete", "pvc", "-n", ns, "data", "--wait=true", "--timeout=120s", timeout=150)
    eventually("the PV to be deleted", lambda: name not in kc.kubectl("get", "pv", "-o", "name"), 120, 0.5)
    eventually("the attachment to go", lambda: not attachments(kc, name), 120, 0.5)
    assert not (kind.SHARED_DIR / "pool" / "volumes" / f"{handle}.img").exists()
    assert not [m for m in node_mounts(kc, second) if name in m or f"/csi/{DRIVER}/" in m]
    assert not host_loops(handle)


def test_wait_for_first_consumer_provisions_on_the_scheduled_node(
    kind_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = kind_cluster, namespace
    target = kc.workers()[1]
    kc.apply(claim(ns, "late", storage_class="kubeloop-wffc"))
    consistently(
        "the WaitForFirstConsumer claim Pending while no pod uses it",
        lambda: kc.get("pvc", "-n", ns, "late").get("status", {}).get("phase"),
        2,
        0.5,
        satisfied=lambda phase: phase == "Pending",
    )
    kc.apply(pod(ns, "consumer", "late", target, SLEEP))
    wait_ready(kc, ns, "consumer")
    pvc = kc.get("pvc", "-n", ns, "late")
    assert pvc["metadata"]["annotations"]["volume.kubernetes.io/selected-node"] == target
    pv = volume_of(kc, ns, "late")
    assert kc.get("pod", "-n", ns, "consumer")["spec"]["nodeName"] == target
    # The pool is shared by every node (a SAN, deploy/kind/cluster.yaml), so the volume is accessible
    # from each node the provisioner asked for; the scheduled one came first, as the preferred segment.
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    nodes = [v for t in terms for e in t["matchExpressions"] for v in e["values"]]
    assert nodes[0] == target and set(nodes) <= set(kc.workers()), nodes
    kc.kubectl("delete", "pod", "-n", ns, "consumer", "--wait=true", "--timeout=120s", timeout=150)
    kc.kubectl("delete", "pvc", "-n", ns, "late", "--wait=true", "--timeout=120s", timeout=150)
    eventually(
        "the PV to be deleted",
        lambda: pv["metadata"]["name"] not in kc.kubectl("get", "pv", "-o", "name"),
        120,
        0.5,
    )


XFS_CLASS = """
apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: kubeloop-test-xfs}
provisioner: loop.csi.kubeloop.dev
parameters: {csi.storage.k8s.io/fstype: xfs}
reclaimPolicy: Delete
allowVolumeExpansion: true
"""


def test_online_expansion_through_the_real_kubelet(kind_cluster: KindCluster, namespace: str) -> None:
    # xfs grows online with CAP_SYS_ADMIN alone; ext4's online resize also needs CAP_SYS_RESOURCE, which
    # a sandboxed host may lack (the driver then answers FAILED_PRECONDITION and grows it offline).
    kc, ns = kind_cluster, namespace
    kc.apply(XFS_CLASS)
    try:
        kc.apply(claim(ns, "grow", size="512Mi", storage_class="kubeloop-test-xfs"))
        kc.apply(pod(ns, "user", "grow", kc.workers()[0], SLEEP))
        wait_ready(kc, ns, "user")

        before = data_kib(kc, ns, "user")
        start = time.monotonic()
        grow(kc, ns, "grow", "768Mi")
        kc.figures["online_expansion_s"] = time.monotonic() - start
        after = data_kib(kc, ns, "user")
        assert after > before + 200 * 1024, (before, after)
        assert (
            kc.get("pv", volume_of(kc, ns, "grow")["metadata"]["name"])["spec"]["capacity"]["storage"]
            == "768Mi"
        )
        kc.kubectl("delete", "pod", "-n", ns, "user", "--wait=true", "--timeout=120s", timeout=150)
        kc.kubectl("delete", "pvc", "-n", ns, "grow", "--wait=true", "--timeout=120s", timeout=150)
    finally:
        kc.kubectl("delete", "storageclass", "kubeloop-test-xfs", check=False)


# (container, the service account it must act as)
IDENTITIES = [
    ("deploy/kubeloop-csi-controller", "csi-provisioner", "kubeloop-external-provisioner"),
    ("deploy/kubeloop-csi-controller", "csi-attacher", "kubeloop-external-attacher"),
    ("deploy/kubeloop-csi-controller", "csi-resizer", "kubeloop-external-resizer"),
    ("deploy/kubeloop-pv-controller", "pv-controller", "kubeloop-pv-controller"),
    ("deploy/kubeloop-attach-detach-controller", "attach-detach-controller", "kubeloop-attach-detach"),
    ("deploy/kubeloop-volume-expand-controller", "volume-expand-controller", "kubeloop-volume-expand"),
]

# What each identity must not be able to do: the rights of one component are not another's.
MUST_NOT = {
    "kubeloop-external-provisioner": [
        "delete pods",
        "create volumeattachments",
        "update nodes",
        "delete persistentvolumeclaims",
    ],
    "kubeloop-external-attacher": [
        "create persistentvolumes",
        "delete persistentvolumeclaims",
        "delete pods",
        "create pods",
    ],
    "kubeloop-external-resizer": [
        "delete persistentvolumes",
        "create volumeattachments",
        "create persistentvolumes",
        "delete pods",
    ],
    "kubeloop-pv-controller": [
        "create volumeattachments",
        "delete pods",
        "update nodes",
        "get secrets",
    ],
    "kubeloop-attach-detach": [
        "create persistentvolumes",
        "delete persistentvolumeclaims",
        "delete pods",
        "get secrets",
    ],
    "kubeloop-volume-expand": [
        "delete persistentvolumes",
        "create volumeattachments",
        "get secrets",
        "delete pods",
    ],
    # external-snapshotter's two (deploy/kubernetes): snapshots only, no volumes, no secrets.
    "kubeloop-snapshot-controller": [
        "delete persistentvolumes",
        "create persistentvolumes",
        "get secrets",
        "delete pods",
    ],
    "kubeloop-csi-snapshotter": [
        "create volumesnapshots",
        "delete volumesnapshotcontents",
        "update persistentvolumeclaims",
        "get secrets",
    ],
    # external-snapshot-metadata's sidecar: reviews and snapshots to read, nothing to change.
    "kubeloop-csi-snapshot-metadata": [
        "delete persistentvolumes",
        "get secrets",
        "update volumesnapshotcontents",
        "delete snapshotmetadataservices",
    ],
    "kubeloop-csi-controller": [
        "list pods",
        "get nodes",
        "list persistentvolumes",
        "get secrets",
    ],
    "kubeloop-csi-node": [
        "list pods",
        "get nodes",
        "list persistentvolumes",
        "get secrets",
    ],
}


def test_each_component_acts_with_its_own_service_account_and_nothing_more(kind_cluster: KindCluster) -> None:
    kc = kind_cluster
    for workload, container, account in IDENTITIES:
        who = kc.kubectl(
            "exec", "-n", "kube-system", workload, "-c", container, "--",
            "kubectl", "auth", "whoami", "-o", "jsonpath={.status.userInfo.username}",
        )  # fmt: skip
        assert who.strip() == f"system:serviceaccount:kube-system:{account}", (container, who)
    # The driver containers hold no token at all.
    for workload in ("deploy/kubeloop-csi-controller", "daemonset/kubeloop-csi-node"):
        kc.kubectl(
            "exec", "-n", "kube-system", workload, "-c", "kubeloop-plugin", "--",
            "sh", "-c", "! test -e /var/run/secrets/kubernetes.io/serviceaccount/token",
        )  # fmt: skip
    allowed = []
    for account, actions in MUST_NOT.items():
        for action in actions:
            verb, resource = action.split()
            answer = kc.kubectl(
                "auth", "can-i", verb, resource, "--all-namespaces",
                f"--as=system:serviceaccount:kube-system:{account}", check=False,
            ).strip()  # fmt: skip
            if answer != "no":
                allowed.append(f"{account} may {action}")
    assert not allowed, allowed
