"""The node finalizer's event reasons and messages: what happened, and what the admin can do.
Claim and volume events are Warnings (data is gone with the node); the Node's summary too when it
took volumes with it."""

from __future__ import annotations

from controller_runtime.storage import ANN_SELECTED_NODE

from .decide import PROVISIONER_FINALIZER, VolumeCleanup

CLAIM_DELETED = "ClaimDeletedNodeGone"
CLAIM_RESCHEDULED = "SelectedNodeGone"
VOLUME_DELETED = "VolumeDeletedNodeGone"
VOLUME_RETAINED = "VolumeRetainedNodeGone"
NODE_CLEANED_UP = "NodeVolumesCleanedUp"
NODE_FINALIZE_SKIPPED = "NodeFinalizeSkipped"

RESTORE = "restore the data from a snapshot or backup held outside that node"


def claim_deleted(node: str, volume: VolumeCleanup) -> str:
    return (
        f"Deleted this claim: its volume {volume.name} was node-local to node {node}, which was deleted "
        "from the cluster, and the data went with the node. A workload that makes the claim again (a "
        f"StatefulSet does) gets a new, empty volume on a node that exists; {RESTORE}."
    )


def claim_rescheduled(node: str) -> str:
    return (
        f"The scheduler chose node {node} for this claim, which was deleted from the cluster before a "
        f"volume was made there: removed the annotation {ANN_SELECTED_NODE} so that the scheduler "
        "chooses another node for the pod that uses it."
    )


def volume_deleted(node: str, volume: VolumeCleanup) -> str:
    return (
        f"Deleting this volume: it was node-local to node {node}, which was deleted from the cluster. No "
        f"provisioner will run DeleteVolume there, so its finalizer {PROVISIONER_FINALIZER} was "
        f"removed; if the machine comes back, its pool still holds the backing file of volume "
        f"{volume.handle} for the admin to remove."
    )


def volume_retained(node: str, volume: VolumeCleanup) -> str:
    return (
        f"Kept (reclaim policy is not Delete): this volume was node-local to node {node}, which was "
        "deleted from the cluster, so no node can stage it unless that machine comes back with its "
        f"pool. Delete this PersistentVolume when you no longer need it; {RESTORE}."
    )


def node_cleaned_up(claims: int, deleted: int, retained: int, rescheduled: int) -> str:
    return (
        f"Node deleted with {deleted + retained} node-local volume(s) of its pool: deleted {claims} "
        f"claim(s) bound to them and {deleted} volume(s), kept {retained} volume(s) whose reclaim policy "
        f"is not Delete; their data is lost ({RESTORE}). Gave {rescheduled} claim(s) waiting for a "
        "volume on this node back to the scheduler."
    )


def skipped_by_flag(volumes: int, waiting: int) -> str:
    return (
        f"--skip-node-finalize: {volumes} node-local volume(s) pinned to this node, the claims bound "
        f"to them and {waiting} claim(s) waiting for a volume on it are left as they are; delete them "
        f"(or the waiting claims' {ANN_SELECTED_NODE} annotation) by hand: their data went with the node."
    )


def skipped_shared_mode(driver: str) -> str:
    return (
        f"Nothing cleaned up: the CSIDriver {driver} is missing or requires attach (shared-pool mode), "
        "where a volume lives in the shared pool and outlives any node."
    )


def skipped_label_mismatch(key: str, label: str) -> str:
    return (
        f"Nothing cleaned up: this Node's label {key}={label} differs from its name, so which volumes "
        "were node-local to it cannot be trusted (a node could name another node's volumes). Delete "
        "the claims and PersistentVolumes pinned to this node by hand if its pool is really gone."
    )
