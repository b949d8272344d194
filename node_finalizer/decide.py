"""The node finalizer's decisions as pure functions: what to do with a Node, which PVs a deleted
Node takes with it, and what cleaning one up means.

A PV is pinned to a node when every term of its required node affinity names that one node
under the driver's topology key (what the external-provisioner writes for a node-local volume).
A PV without affinity, or accessible from several nodes, is a shared-pool volume and never
touched; so is every volume while the driver's CSIDriver says shared mode (attachRequired). A
claim still waiting for a volume on the deleted node is given back to the scheduler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from controller_runtime.attach_rules import attach_required
from controller_runtime.driver_names import DRIVER_NAME as DRIVER_NAME
from controller_runtime.driver_names import TOPOLOGY_KEY as TOPOLOGY_KEY
from controller_runtime.kinds import (
    CSIDriver,
    Node,
    PersistentVolume,
    PersistentVolumeClaim,
    node_view,
    pv_view,
    pvc_view,
)
from controller_runtime.node_affinity import required_affinity
from controller_runtime.resources import Obj
from controller_runtime.storage import (
    ANN_BETA_STORAGE_PROVISIONER,
    ANN_SELECTED_NODE,
    ANN_STORAGE_PROVISIONER,
    DELETE,
    is_deleting,
)

# The external-provisioner's PV finalizer: a process package imports no other, so the name is
# repeated here and a unit test holds them equal (the driver's names come from the shared layer).
PROVISIONER_FINALIZER = "external-provisioner.volume.kubernetes.io/finalizer"
# This controller's finalizer on every Node.
FINALIZER = "loop.csi.kubeloop.dev/node"


class NodeStep(Enum):
    NOTHING = "nothing"
    ADD_FINALIZER = "add-finalizer"  # a live Node without our finalizer
    FINALIZE = "finalize"  # a Node being deleted that still carries it


def finalizers(obj: Node | PersistentVolume) -> list[str]:
    return list(obj["metadata"].get("finalizers") or [])


def node_step(node: Node) -> NodeStep:
    """Only a deletion counts: a Node that is NotReady, cordoned or tainted is left alone."""
    ours = FINALIZER in finalizers(node)
    if is_deleting(node):
        return NodeStep.FINALIZE if ours else NodeStep.NOTHING
    return NodeStep.NOTHING if ours else NodeStep.ADD_FINALIZER


def topology_value(node: Node) -> str | None:
    """The value a volume pinned to this Node carries under the topology key: its name (the
    driver's --node-id is the node name in every deployment kubeloop ships, and kubelet copies it
    into the Node's label). None when the label names something else: kubelet writes its Node's
    labels and NodeRestriction does not guard this key, so a node believed by its label could name
    another node's volumes and have them deleted with its own Node object."""
    md = node["metadata"]
    label = (md.get("labels") or {}).get(TOPOLOGY_KEY)
    if label is not None and label != md["name"]:
        return None
    return str(md["name"])


def pinned_value(pv: PersistentVolume) -> str | None:
    """The one node a PV of the driver is accessible from, or None when it is not one node's."""
    csi = (pv.get("spec") or {}).get("csi") or {}
    required = required_affinity(pv)
    if csi.get("driver") != DRIVER_NAME or required is None:
        return None
    named: set[str] = set()
    for term in required.get("nodeSelectorTerms") or []:
        values = [
            tuple(e.get("values") or ())
            for e in term.get("matchExpressions") or []
            if e.get("key") == TOPOLOGY_KEY and e.get("operator") == "In"
        ]
        if len(values) != 1 or len(values[0]) != 1:
            return None  # a term that another node could satisfy (or that names several)
        named.add(str(values[0][0]))
    return named.pop() if len(named) == 1 else None


def node_local_driver(csidriver: CSIDriver | None) -> bool:
    """Node-local mode is the CSIDriver with attachRequired false (its default is true): in shared
    mode a volume pinned to one node (strict topology) still lives in the shared pool, and a
    missing CSIDriver says nothing; neither is cleaned up."""
    return csidriver is not None and not attach_required(csidriver)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class VolumeCleanup:
    """One PV a deleted Node takes with it."""

    name: str
    uid: str
    handle: str
    claim: ClaimRef | None  # the claim it is bound to (its claimRef with a UID), to delete
    delete: bool  # reclaim policy Delete: the PV goes too; Retain and Recycle keep it


def cleanup(pv: PersistentVolume, node_value: str) -> VolumeCleanup | None:
    """What cleaning up `pv` means when the Node whose topology value is `node_value` is deleted;
    None when the PV is not pinned to that node."""
    if pinned_value(pv) != node_value:
        return None
    spec, md = pv.get("spec") or {}, pv["metadata"]
    ref = spec.get("claimRef") or {}
    claim = None
    if ref.get("uid") and ref.get("name") and ref.get("namespace"):
        claim = ClaimRef(str(ref["namespace"]), str(ref["name"]), str(ref["uid"]))
    return VolumeCleanup(
        name=str(md["name"]),
        uid=str(md.get("uid") or ""),
        handle=str((spec.get("csi") or {}).get("volumeHandle") or ""),
        claim=claim,
        delete=spec.get("persistentVolumeReclaimPolicy") == DELETE,
    )


def claim_to_delete(claim: PersistentVolumeClaim | None, ref: ClaimRef) -> bool:
    """The claim still stands and is the one the PV was bound to (a claim of the same name made
    since, by a StatefulSet say, has another UID and is left alone)."""
    return claim is not None and claim["metadata"].get("uid") == ref.uid and not is_deleting(claim)


def waits_for_node(claim: PersistentVolumeClaim, node_name: str) -> bool:
    """A claim of the driver, not bound yet, for which the scheduler chose this node: the
    kube-scheduler then considers no other node for its pod (volumebinding skips every node but
    the selected one), and no provisioner but this node's ever takes it, so it would wait forever."""
    md, spec = claim["metadata"], claim.get("spec") or {}
    annotations = md.get("annotations") or {}
    provisioner = annotations.get(ANN_STORAGE_PROVISIONER) or annotations.get(ANN_BETA_STORAGE_PROVISIONER)
    return (
        provisioner == DRIVER_NAME
        and not spec.get("volumeName")
        and not is_deleting(claim)
        and annotations.get(ANN_SELECTED_NODE) == node_name
    )


# Edits of an object's current version: the metadata to merge into it, None when there is nothing
# to write (any more). They are re-applied to a fresh copy after a conflict, so they take the object
# as fetched and view it as its kind.


def add_node_finalizer(obj: Obj) -> Obj | None:
    node = node_view(obj)
    if node_step(node) is not NodeStep.ADD_FINALIZER:
        return None
    return {"finalizers": [*finalizers(node), FINALIZER]}


def remove_node_finalizer(obj: Obj) -> Obj | None:
    have = finalizers(node_view(obj))
    return {"finalizers": [f for f in have if f != FINALIZER]} if FINALIZER in have else None


def remove_provisioner_finalizer(obj: Obj) -> Obj | None:
    """The external-provisioner's finalizer removed, from a PV being deleted only: no provisioner
    runs DeleteVolume on a node that is gone."""
    pv = pv_view(obj)
    have = finalizers(pv)
    if PROVISIONER_FINALIZER not in have or not is_deleting(pv):
        return None
    return {"finalizers": [f for f in have if f != PROVISIONER_FINALIZER]}


def forget_selected_node(node_name: str) -> Callable[[Obj], Obj | None]:
    """Removes the scheduler's choice of this node from a claim that waits for it (what a
    provisioner does when it cannot provision on the selected node), so the scheduler picks again."""

    def edit(claim: Obj) -> Obj | None:
        return (
            {"annotations": {ANN_SELECTED_NODE: None}} if waits_for_node(pvc_view(claim), node_name) else None
        )

    return edit
