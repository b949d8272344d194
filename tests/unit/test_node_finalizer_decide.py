"""The node finalizer's pure decisions: what a Node needs, which PVs a deleted Node takes with it
(node-local ones pinned to it only), and what cleaning one up touches."""

from __future__ import annotations

import pytest

import csi_driver
from controller_runtime.kinds import csi_driver_view, node_view, pv_view, pvc_view
from controller_runtime.resources import Obj
from external_provisioner import names
from node_finalizer.decide import (
    DRIVER_NAME,
    FINALIZER,
    PROVISIONER_FINALIZER,
    TOPOLOGY_KEY,
    ClaimRef,
    NodeStep,
    VolumeCleanup,
    add_node_finalizer,
    claim_to_delete,
    cleanup,
    forget_selected_node,
    node_local_driver,
    node_step,
    pinned_value,
    remove_node_finalizer,
    remove_provisioner_finalizer,
    topology_value,
    waits_for_node,
)

DELETED = "2026-11-25T06:00:00Z"
PV_PROTECTION = "kubernetes.io/pv-protection"


def test_the_names_are_the_drivers_and_the_provisioners() -> None:
    assert (DRIVER_NAME, TOPOLOGY_KEY) == (csi_driver.DRIVER_NAME, csi_driver.TOPOLOGY_KEY)
    assert PROVISIONER_FINALIZER == names.PV_FINALIZER


def node(
    name: str = "node-a",
    *,
    finalizers: tuple[str, ...] = (),
    deleting: bool = False,
    labels: dict[str, str] | None = None,
) -> Obj:
    md: Obj = {"name": name, "finalizers": list(finalizers), "labels": labels or {}}
    if deleting:
        md["deletionTimestamp"] = DELETED
    return {"metadata": md, "status": {"conditions": [{"type": "Ready", "status": "False"}]}}


@pytest.mark.parametrize(
    ("n", "step"),
    [
        (node(), NodeStep.ADD_FINALIZER),
        (node(finalizers=("other/finalizer",)), NodeStep.ADD_FINALIZER),
        # NotReady (every node here is) is no reason to do anything once the finalizer is on.
        (node(finalizers=(FINALIZER,)), NodeStep.NOTHING),
        (node(finalizers=(FINALIZER,), deleting=True), NodeStep.FINALIZE),
        # Being deleted without our finalizer (released already, or never added): nothing to add.
        (node(finalizers=("other/finalizer",), deleting=True), NodeStep.NOTHING),
    ],
)
def test_node_step(n: Obj, step: NodeStep) -> None:
    assert node_step(node_view(n)) is step


def test_topology_value_is_the_name_and_a_label_naming_another_node_is_not_believed() -> None:
    assert topology_value(node_view(node("node-a"))) == "node-a"
    assert topology_value(node_view(node("node-a", labels={TOPOLOGY_KEY: "node-a"}))) == "node-a"
    # kubelet writes its Node's labels: a node naming another node's value gets nothing cleaned up.
    assert topology_value(node_view(node("node-a", labels={TOPOLOGY_KEY: "node-b"}))) is None


def term(*exprs: Obj) -> Obj:
    return {"matchExpressions": list(exprs)}


def on(*values: str, key: str = TOPOLOGY_KEY, op: str = "In") -> Obj:
    return {"key": key, "operator": op, "values": list(values)}


def pv(
    *terms: Obj,
    driver: str = DRIVER_NAME,
    policy: str = "Delete",
    claim: Obj | None = None,
    finalizers: tuple[str, ...] = (),
) -> Obj:
    spec: Obj = {
        "csi": {"driver": driver, "volumeHandle": "pvc-1"},
        "persistentVolumeReclaimPolicy": policy,
    }
    if terms:
        spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": list(terms)}}
    if claim is not None:
        spec["claimRef"] = claim
    return {"metadata": {"name": "pv-1", "uid": "u-pv", "finalizers": list(finalizers)}, "spec": spec}


@pytest.mark.parametrize(
    ("volume", "pinned"),
    [
        # What the provisioner writes for a node-local volume.
        (pv(term(on("node-a"))), "node-a"),
        # Further restricted: still that node only.
        (pv(term(on("node-a"), on("ssd", key="disk"))), "node-a"),
        # The same node in every term.
        (pv(term(on("node-a")), term(on("node-a"), on("x", key="y"))), "node-a"),
        # A shared-pool volume: no affinity, several nodes, or a term another node can satisfy.
        (pv(), None),
        (pv(term(on("node-a")), term(on("node-b"))), None),
        (pv(term(on("node-a", "node-b"))), None),
        (pv(term(on("node-b", op="NotIn"))), None),
        (pv(term(on("ssd", key="disk"))), None),
        (pv(term(on("node-a")), term(on("ssd", key="disk"))), None),
        # Another driver's volume on that node.
        (pv(term(on("node-a")), driver="topolvm.io"), None),
    ],
)
def test_pinned_value(volume: Obj, pinned: str | None) -> None:
    assert pinned_value(pv_view(volume)) == pinned


CLAIM_REF = {"namespace": "ns", "name": "data-0", "uid": "u-claim"}


def test_cleanup_of_a_pinned_volume() -> None:
    volume = pv_view(pv(term(on("node-a")), claim=CLAIM_REF))
    assert cleanup(volume, "node-b") is None
    assert cleanup(volume, "node-a") == VolumeCleanup(
        "pv-1", "u-pv", "pvc-1", ClaimRef("ns", "data-0", "u-claim"), delete=True
    )
    # Retain (and Recycle) keep the PV; a claimRef without a UID binds nothing yet.
    kept = cleanup(
        pv_view(pv(term(on("node-a")), policy="Retain", claim={"namespace": "ns", "name": "x"})), "node-a"
    )
    assert kept == VolumeCleanup("pv-1", "u-pv", "pvc-1", None, delete=False)
    recycled = cleanup(pv_view(pv(term(on("node-a")), policy="Recycle")), "node-a")
    assert recycled is not None and not recycled.delete


def claim(uid: str, deleting: bool = False) -> Obj:
    md: Obj = {"name": "data-0", "namespace": "ns", "uid": uid}
    if deleting:
        md["deletionTimestamp"] = DELETED
    return {"metadata": md}


def test_only_the_bound_claim_itself_is_deleted_and_once() -> None:
    ref = ClaimRef("ns", "data-0", "u-claim")
    assert claim_to_delete(pvc_view(claim("u-claim")), ref)
    assert not claim_to_delete(None, ref)
    # A StatefulSet made a new claim of the same name: not ours to delete.
    assert not claim_to_delete(pvc_view(claim("u-new")), ref)
    # Already being deleted (an earlier sync, or held by pvc-protection): not again.
    assert not claim_to_delete(pvc_view(claim("u-claim", deleting=True)), ref)


def test_only_the_provisioners_finalizer_is_removed_and_from_a_deleted_pv_only() -> None:
    both = pv(finalizers=(PV_PROTECTION, PROVISIONER_FINALIZER))
    assert remove_provisioner_finalizer(both) is None, "not being deleted"
    both["metadata"]["deletionTimestamp"] = DELETED
    assert remove_provisioner_finalizer(both) == {"finalizers": [PV_PROTECTION]}
    protected = pv(finalizers=(PV_PROTECTION,))
    protected["metadata"]["deletionTimestamp"] = DELETED
    assert remove_provisioner_finalizer(protected) is None


def test_the_node_finalizer_is_added_to_a_live_node_and_removed_from_a_deleted_one() -> None:
    assert add_node_finalizer(node(finalizers=("other",))) == {"finalizers": ["other", FINALIZER]}
    assert add_node_finalizer(node(finalizers=(FINALIZER,))) is None
    assert add_node_finalizer(node(deleting=True)) is None, "no new finalizer on a Node being deleted"
    deleted = node(finalizers=("other", FINALIZER), deleting=True)
    assert remove_node_finalizer(deleted) == {"finalizers": ["other"]}
    assert remove_node_finalizer(node(finalizers=("other",), deleting=True)) is None


def pending(
    selected: str | None = "node-a",
    provisioner: str = DRIVER_NAME,
    beta: bool = False,
    volume: str = "",
    deleting: bool = False,
) -> Obj:
    key = (
        "volume.beta.kubernetes.io/storage-provisioner"
        if beta
        else "volume.kubernetes.io/storage-provisioner"
    )
    annotations = {key: provisioner}
    if selected is not None:
        annotations["volume.kubernetes.io/selected-node"] = selected
    md: Obj = {"name": "data-0", "namespace": "ns", "annotations": annotations}
    if deleting:
        md["deletionTimestamp"] = DELETED
    return {"metadata": md, "spec": {"volumeName": volume} if volume else {}}


@pytest.mark.parametrize(
    ("claim", "waits"),
    [
        (pending(), True),
        (pending(beta=True), True),
        (pending(selected="node-b"), False),
        (pending(selected=None), False),
        (pending(provisioner="topolvm.io"), False),  # another driver's claim
        (pending(volume="pv-1"), False),  # bound (or binding): its volume decides, not the choice
        (pending(deleting=True), False),
    ],
)
def test_a_claim_waiting_for_the_deleted_node_is_given_back_to_the_scheduler(claim: Obj, waits: bool) -> None:
    assert waits_for_node(pvc_view(claim), "node-a") is waits
    expected = {"annotations": {"volume.kubernetes.io/selected-node": None}} if waits else None
    assert forget_selected_node("node-a")(claim) == expected


@pytest.mark.parametrize(
    ("csidriver", "local"),
    [
        ({"spec": {"attachRequired": False, "storageCapacity": True}}, True),
        ({"spec": {"attachRequired": True}}, False),
        ({"spec": {}}, False),  # attachRequired defaults to true
        (None, False),
    ],
)
def test_node_local_mode_is_the_csidriver_without_attach(csidriver: Obj | None, local: bool) -> None:
    assert node_local_driver(csi_driver_view(csidriver)) is local
