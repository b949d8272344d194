"""The provisioner's decisions that depend only on objects and the driver's capabilities, kept
apart from the I/O so each can be tested on its own: which data source a claim names and whether
the driver can provision it, whether a clone or restore may have the claim's volume mode, which
PVs are this provisioner's to finalize and delete, which secret DeleteVolume gets, and when a clone
source's protection may go. Each follows the Go sidecar
(kubernetes-csi/external-provisioner v6 with sig-storage-lib-external-provisioner v13); the
messages are its messages, since they reach events."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from controller_runtime import node_affinity, storage
from controller_runtime.goflags import parse_bool
from controller_runtime.kinds import (
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    VolumeSnapshotContent,
)
from controller_runtime.storage import is_deleting, volume_class
from kubeloop_grpc.csi import csi_pb2

from . import names
from .request import ProvisionError, SecretRef, secret_reference

RPC = csi_pb2.ControllerServiceCapability.RPC
SERVICE = csi_pb2.PluginCapability.Service

CLONE_KIND = "PersistentVolumeClaim"
SNAPSHOT_KIND = "VolumeSnapshot"
SNAPSHOT_GROUP = "snapshot.storage.k8s.io"


# -- data sources and capabilities -----------------------------------------------------------------


@dataclass(frozen=True)
class DataSource:
    kind: str
    name: str
    namespace: str
    api_group: str

    @property
    def clone(self) -> bool:
        return self.kind == CLONE_KIND

    @property
    def snapshot(self) -> bool:
        return self.kind == SNAPSHOT_KIND

    @property
    def populated(self) -> bool:
        """Neither a claim nor a snapshot: a volume populator's job, not ours."""
        return not (self.clone or self.snapshot)


def data_source(claim: PersistentVolumeClaim) -> DataSource | None:
    """The claim's data source as the sidecar reads it: `dataSource` first, else `dataSourceRef`
    (whose namespace needs the CrossNamespaceVolumeDataSource gate, off by default). Raises the
    errors that end a provisioning attempt before any capability is looked at."""
    spec, md = claim.get("spec", {}), claim["metadata"]
    ref = spec.get("dataSource")
    namespace = md["namespace"]
    if not ref:
        ref = spec.get("dataSourceRef")
        if not ref:
            return None
        if ref.get("namespace"):
            raise ProvisionError(
                "dataSourceRef namespace specified but the CrossNamespaceVolumeDataSource feature is disabled"
            )
    source = DataSource(
        kind=ref.get("kind") or "",
        name=ref.get("name") or "",
        namespace=namespace,
        api_group=ref.get("apiGroup") or "",
    )
    if not source.name:
        raise ProvisionError(f"the PVC source not found for PVC {md['name']}")
    if source.snapshot and source.api_group != SNAPSHOT_GROUP:
        raise ProvisionError(
            "the PVC source does not belong to the right APIGroup. "
            f"Expected {SNAPSHOT_GROUP}, Got {source.api_group}"
        )
    return source


def _missing(what: str, capability: str) -> str:
    return f"CSI driver does not support {what}: {capability} capability is not reported"


def capability_error(
    plugin: Iterable[int], controller: Iterable[int], *, source: DataSource | None, modify: bool
) -> str | None:
    """Why the driver cannot provision this claim, or None. Checked for every claim (and before
    every DeleteVolume, with no source), never at start: a driver lacking CREATE_DELETE_VOLUME
    still runs, and each claim says why it stays Pending."""
    plugin, controller = set(plugin), set(controller)
    if SERVICE.CONTROLLER_SERVICE not in plugin:
        return _missing("dynamic provisioning", "plugin CONTROLLER_SERVICE")
    if RPC.CREATE_DELETE_VOLUME not in controller:
        return _missing("dynamic provisioning", "controller CREATE_DELETE_VOLUME")
    if source is not None and source.snapshot and RPC.CREATE_DELETE_SNAPSHOT not in controller:
        return _missing("snapshot restore", "controller CREATE_DELETE_SNAPSHOT")
    if source is not None and source.clone and RPC.CLONE_VOLUME not in controller:
        return _missing("clone operations", "controller CLONE_VOLUME")
    if modify and RPC.MODIFY_VOLUME not in controller:
        return _missing("VolumeAttributesClass", "controller MODIFY_VOLUME")
    return None


# -- volumes: which are ours, their finalizer, when to delete -------------------------------------


def _annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return obj.get("metadata", {}).get("annotations") or {}


def responsible_for(pv: PersistentVolume, driver: str) -> bool:
    """Whether this provisioner finalizes and deletes the PV. One it provisioned (provisioned-by
    or migrated-to names the driver) — and, without provisioned-by, a PV an admin created for the
    driver (spec.csi.driver): a static CSI volume with reclaim policy Delete is deleted in the
    backend like a provisioned one."""
    ann = _annotations(pv)
    if storage.ANN_PROVISIONED_BY in ann:
        return driver in (ann.get(storage.ANN_PROVISIONED_BY), ann.get(storage.ANN_MIGRATED_TO))
    csi = pv.get("spec", {}).get("csi")
    if csi is not None:
        return bool(csi.get("driver") == driver)
    return ann.get(storage.ANN_MIGRATED_TO) == driver


def finalizers_after(pv: PersistentVolume) -> list[str] | None:
    """The PV's finalizers once PV_FINALIZER is where it belongs, None if unchanged: added to a
    Bound, not deleting PV with policy Delete (so deleting the PV first still deletes the
    volume), removed when the policy is Retain or Recycle (the volume outlives the PV)."""
    current = list(pv.get("metadata", {}).get("finalizers") or [])
    policy = pv.get("spec", {}).get("persistentVolumeReclaimPolicy")
    phase = pv.get("status", {}).get("phase")
    if policy in (storage.RETAIN, storage.RECYCLE):
        if names.PV_FINALIZER in current:
            return [f for f in current if f != names.PV_FINALIZER]
        return None
    if (
        policy == storage.DELETE
        and not is_deleting(pv)
        and phase == storage.PV_BOUND
        and names.PV_FINALIZER not in current
    ):
        return [*current, names.PV_FINALIZER]
    return None


def should_delete(pv: PersistentVolume) -> bool:
    """Released with policy Delete, and — once the PV is being deleted — still holding our
    finalizer (without it the volume was deleted already). A PV in any other phase is left
    alone even when deleted, as upstream does: its finalizer stays until an admin removes it."""
    md = pv.get("metadata", {})
    if is_deleting(pv) and names.PV_FINALIZER not in (md.get("finalizers") or []):
        return False
    return bool(
        pv.get("status", {}).get("phase") == storage.PV_RELEASED
        and pv.get("spec", {}).get("persistentVolumeReclaimPolicy") == storage.DELETE
    )


def deletion_secret(pv: PersistentVolume, storage_class: StorageClass | None) -> SecretRef | None:
    """The secret DeleteVolume gets. The PV's deletion-secret annotations when it has both (empty
    values: none); a PV without them (provisioned before they existed, or static) falls back to
    its class's provisioner secret resolved for its claimRef — which cannot use the claim's
    annotations any more: such a template is an error. No class or no claimRef: no secret."""
    ann = _annotations(pv)
    if names.ANN_DELETION_SECRET_NAME in ann and names.ANN_DELETION_SECRET_NAMESPACE in ann:
        name, namespace = ann[names.ANN_DELETION_SECRET_NAME], ann[names.ANN_DELETION_SECRET_NAMESPACE]
        return SecretRef(name, namespace) if name and namespace else None
    if storage_class is None or not volume_class(pv):
        return None
    ref = pv.get("spec", {}).get("claimRef")
    if not ref:
        return None
    pv_name = pv["metadata"]["name"]
    try:
        return secret_reference(
            "provisioner",
            storage_class.get("parameters") or {},
            pv_name,
            ref.get("namespace") or "",
            ref.get("name") or "",
            {},
        )
    except ProvisionError as exc:
        raise ProvisionError(f"failed to get secretreference for volume {pv_name}: {exc}") from exc


# -- clone sources ---------------------------------------------------------------------------------


def pending_clones(source: PersistentVolumeClaim, claims: Iterable[PersistentVolumeClaim]) -> list[str]:
    """Claims in the source's namespace still being cloned from it: Pending, with a
    PersistentVolumeClaim `dataSource` of the source's name. While any exists, the source keeps
    its cloning-protection finalizer."""
    md = source["metadata"]
    found = []
    for claim in claims:
        cmd, spec = claim["metadata"], claim.get("spec", {})
        ds = spec.get("dataSource") or {}
        if (
            cmd.get("namespace") == md["namespace"]
            and ds.get("kind") == CLONE_KIND
            and ds.get("name") == md["name"]
            and claim.get("status", {}).get("phase") == storage.CLAIM_PENDING
        ):
            found.append(cmd["name"])
    return sorted(found)


# -- snapshot sources ------------------------------------------------------------------------------


def restored_snapshot(claim: PersistentVolumeClaim) -> str | None:
    """`namespace/name` of the VolumeSnapshot a claim restores from (its `dataSource`, else its
    `dataSourceRef`; no apiGroup counts as the snapshot group, as upstream reads it), or None."""
    spec, ns = claim.get("spec", {}), claim["metadata"]["namespace"]
    for ref in (spec.get("dataSource") or {}, spec.get("dataSourceRef") or {}):
        if ref.get("kind") == SNAPSHOT_KIND and ref.get("apiGroup") in (None, SNAPSHOT_GROUP):
            return f"{ref.get('namespace') or ns}/{ref.get('name', '')}"
    return None


def pending_restores(claims: Iterable[PersistentVolumeClaim]) -> set[str]:
    """The snapshots some claim still restores from: one not yet Bound (phase Pending, or none
    yet). A snapshot outside this set may lose its source protection."""
    found = set()
    for claim in claims:
        if claim.get("status", {}).get("phase") not in (storage.CLAIM_PENDING, "", None):
            continue
        key = restored_snapshot(claim)
        if key is not None:
            found.add(key)
    return found


# -- the volume mode of a copy ----------------------------------------------------------------------

FILESYSTEM, BLOCK = "Filesystem", "Block"
_CLONE_MODES = "the source PVC and destination PVCs must have the same volume mode for cloning.  "


def clone_mode_error(claim: PersistentVolumeClaim, source_pv: PersistentVolume) -> str | None:
    """Why a clone cannot have the claim's volumeMode, else None. A clone keeps its source's mode,
    always: upstream's getPVCSource checks it whatever --prevent-volume-mode-conversion says, and no
    annotation lifts it. A missing mode is Filesystem on either side."""
    want = claim.get("spec", {}).get("volumeMode")
    have = source_pv.get("spec", {}).get("volumeMode")
    if (want is None or want == FILESYSTEM) and have is not None and have != FILESYSTEM:
        return _CLONE_MODES + "Source is Block, but new PVC requested Filesystem"
    if want == BLOCK and have != BLOCK:
        return _CLONE_MODES + "Source is Filesystem, but new PVC requested Block"
    return None


def restore_mode_error(
    claim: PersistentVolumeClaim, content: VolumeSnapshotContent, *, prevent: bool
) -> str | None:
    """Why a claim may not be restored from a VolumeSnapshotContent in another volume mode than the
    snapshotted volume's, else None: upstream's --prevent-volume-mode-conversion (on by default).
    The modes are compared only when both are set, as upstream does: a content without
    `spec.sourceVolumeMode` (a pre-provisioned one, or one a snapshot-controller made with its own
    --prevent-volume-mode-conversion off) is let through, and so is a claim without a mode, which
    the apiserver never stores. A change needs the content's allow-volume-mode-change annotation."""
    source_mode = content.get("spec", {}).get("sourceVolumeMode")
    claim_mode = claim.get("spec", {}).get("volumeMode")
    if not prevent or source_mode is None or claim_mode is None or source_mode == claim_mode:
        return None
    md, name, key = claim["metadata"], content["metadata"]["name"], storage.ANN_ALLOW_VOLUME_MODE_CHANGE
    refused = (
        f"requested volume {md['namespace']}/{md['name']} modifies the mode of the source volume but "
        "does not have permission to do so. "
    )
    value = _annotations(content).get(key)
    if value is None:
        return refused + f"{key} annotation is not present on snapshotcontent {name}"
    try:
        allowed = parse_bool(value)
    except ValueError as exc:
        return refused + f"failed to convert {key} annotation value to boolean with error: {exc}"
    if not allowed:
        return refused + f"{key} is set to false on snapshotcontent {name}"
    return None


def mode_change_granted(content: VolumeSnapshotContent) -> bool:
    """Whether an admin allowed claims restored from this VolumeSnapshotContent another volume
    mode (its annotation reads true as Go's ParseBool reads it). kubeloop's provisioner passes the
    grant on to the driver, which refuses a mode change it is not told about (docs/contracts.md)."""
    value = _annotations(content).get(storage.ANN_ALLOW_VOLUME_MODE_CHANGE)
    if value is None:
        return False
    try:
        return parse_bool(value)
    except ValueError:
        return False


# -- infeasible requests ---------------------------------------------------------------------------


@dataclass
class SlowRetries:
    """Claims whose CreateVolume was refused with INVALID_ARGUMENT: the same request cannot succeed,
    so the claim is not tried again for `delay` (--retry-interval-max) — unless its class changed
    (another UID: deleted and re-created), which may fix the request."""

    delay: float
    marked: dict[str, tuple[float, str]] = field(default_factory=dict)  # claim UID -> (when, class UID)

    def mark(self, claim_uid: str, class_uid: str, now: float) -> None:
        self.marked.setdefault(claim_uid, (now, class_uid))

    def remaining(self, claim_uid: str, class_uid: str, now: float) -> float:
        """Seconds the claim must still wait; 0 when it may be provisioned."""
        found = self.marked.get(claim_uid)
        if found is None:
            return 0.0
        left = found[0] + self.delay - now
        if found[1] != class_uid or left <= 0:
            del self.marked[claim_uid]
            return 0.0
        return left

    def forget(self, claim_uid: str) -> None:
        self.marked.pop(claim_uid, None)


# -- node deployment -------------------------------------------------------------------------------


class NodeCheck(Enum):
    """What a node-deployment provisioner does with a pending claim (upstream's checkNode)."""

    PROVISION = "provision"  # its selected node is this node
    IGNORE = "ignore"  # another node's, a WaitForFirstConsumer claim not scheduled yet, or not servable here
    ELECT = "elect"  # Immediate and nobody's yet: try to become its owner


def node_check(
    claim: PersistentVolumeClaim,
    storage_class: StorageClass,
    node_name: str,
    *,
    immediate_binding: bool,
    allowed_here: bool,
) -> NodeCheck:
    """Whether this node provisions the claim, ignores it, or tries to own it first. An Immediate
    claim is tried only with --node-deployment-immediate-binding and when the class's
    allowedTopologies admit this node (`allowed_here`); anything else no node has selected waits
    for the scheduler (or for a controller of the admin's that writes selected-node)."""
    selected = _annotations(claim).get(storage.ANN_SELECTED_NODE) or ""
    if selected:
        return NodeCheck.PROVISION if selected == node_name else NodeCheck.IGNORE
    if storage_class.get("volumeBindingMode", "Immediate") != "Immediate" or not immediate_binding:
        return NodeCheck.IGNORE
    return NodeCheck.ELECT if allowed_here else NodeCheck.IGNORE


def volume_accessible(pv: PersistentVolume, segment: Mapping[str, str]) -> bool:
    """Whether a node whose labels are just `segment` (its driver's NodeGetInfo topology) satisfies
    the PV's node affinity: upstream's VolumeIsAccessible, which decides which node-deployment
    provisioner deletes a volume. No affinity, or no topology from the driver: every node. The
    node is known by its labels only, so a term that selects by field matches nothing."""
    required = node_affinity.required_affinity(pv)
    if not segment or required is None:
        return True
    terms = [t for t in required.get("nodeSelectorTerms") or [] if not t.get("matchFields")]
    return node_affinity.selector_matches(
        {"nodeSelectorTerms": terms}, {"metadata": {"labels": dict(segment)}}
    )
