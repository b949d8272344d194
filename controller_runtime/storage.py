"""The Kubernetes storage vocabulary that the binder and the provisioner share: well-known
annotation keys, phases, reclaim policies, the event reasons both emit, access modes, and small
readers of claims, volumes and classes (see docs/contracts.md). Pure functions over plain dicts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .quantity import parse_quantity
from .resources import Obj

# -- annotations ---------------------------------------------------------------------------------

ANN_BIND_COMPLETED = "pv.kubernetes.io/bind-completed"
ANN_BOUND_BY_CONTROLLER = "pv.kubernetes.io/bound-by-controller"
ANN_PROVISIONED_BY = "pv.kubernetes.io/provisioned-by"
ANN_MIGRATED_TO = "pv.kubernetes.io/migrated-to"
ANN_STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
ANN_BETA_STORAGE_PROVISIONER = "volume.beta.kubernetes.io/storage-provisioner"
ANN_SELECTED_NODE = "volume.kubernetes.io/selected-node"
ANN_BETA_STORAGE_CLASS = "volume.beta.kubernetes.io/storage-class"
ANN_DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"
ANN_BETA_DEFAULT_CLASS = "storageclass.beta.kubernetes.io/is-default-class"
# On a VolumeSnapshotContent, set by an admin: a claim restored from it may have another volumeMode
# than the snapshotted volume (KEP-3141, external-provisioner's --prevent-volume-mode-conversion).
# kubeloop's provisioner passes the grant on to the driver as a CreateVolume parameter of this key.
ANN_ALLOW_VOLUME_MODE_CHANGE = "snapshot.storage.kubernetes.io/allow-volume-mode-change"
NO_PROVISIONER = "kubernetes.io/no-provisioner"  # a StorageClass provisioner: no dynamic provisioning
YES = "yes"  # the value of bind-completed and bound-by-controller

# -- phases and reclaim policies -----------------------------------------------------------------

PV_AVAILABLE = "Available"
PV_BOUND = "Bound"
PV_RELEASED = "Released"
PV_FAILED = "Failed"
CLAIM_PENDING = "Pending"
CLAIM_BOUND = "Bound"
CLAIM_LOST = "Lost"

RETAIN = "Retain"
DELETE = "Delete"
RECYCLE = "Recycle"

# -- event reasons both the binder and the provisioner emit ------------------------------------------

PROVISIONING_FAILED = "ProvisioningFailed"
VOLUME_FAILED_DELETE = "VolumeFailedDelete"

# -- access modes --------------------------------------------------------------------------------

RWO, ROX, RWX, RWOP = "ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"

# The fixed order kcm writes access-mode sets in (its index keys look like "RWO,ROX").
ACCESS_MODES: tuple[tuple[str, str], ...] = ((RWO, "RWO"), (ROX, "ROX"), (RWX, "RWX"), (RWOP, "RWOP"))
_FULL = {short: full for full, short in ACCESS_MODES}


def access_modes_key(modes: Iterable[str]) -> str:
    """The canonical index key of a set of access modes, e.g. ["ReadWriteMany", "ReadWriteOnce"] ->
    "RWO,RWX". Unknown modes are ignored, as the apiserver never stores them."""
    present = set(modes)
    return ",".join(short for full, short in ACCESS_MODES if full in present)


def modes_of_key(key: str) -> frozenset[str]:
    return frozenset(_FULL[s] for s in key.split(",") if s in _FULL)


def contains_access_modes(offered: Iterable[str], requested: Iterable[str]) -> bool:
    return set(requested) <= set(offered)


# -- claims, volumes, classes ----------------------------------------------------------------------


def storage_of(resources: Obj | None) -> int:
    return parse_quantity((resources or {}).get("storage"))


def volume_capacity(volume: Mapping[str, Any]) -> int:
    return storage_of(volume.get("spec", {}).get("capacity"))


def claim_request(claim: Mapping[str, Any]) -> int:
    return storage_of(claim.get("spec", {}).get("resources", {}).get("requests"))


def _class_of(obj: Mapping[str, Any]) -> str:
    """A PV's or PVC's class; the beta annotation wins over the field, and nil means "" (no class)."""
    ann = obj.get("metadata", {}).get("annotations") or {}
    if ANN_BETA_STORAGE_CLASS in ann:
        return str(ann[ANN_BETA_STORAGE_CLASS])
    return str(obj.get("spec", {}).get("storageClassName") or "")


def claim_class(claim: Mapping[str, Any]) -> str:
    return _class_of(claim)


def claim_has_class(claim: Mapping[str, Any]) -> bool:
    """True when the user chose a class, even "": only a nil class gets the default one."""
    ann = claim.get("metadata", {}).get("annotations") or {}
    return ANN_BETA_STORAGE_CLASS in ann or claim.get("spec", {}).get("storageClassName") is not None


def volume_class(volume: Mapping[str, Any]) -> str:
    return _class_of(volume)


def is_deleting(obj: Mapping[str, Any]) -> bool:
    return bool(obj.get("metadata", {}).get("deletionTimestamp"))


def claim_reference(claim: Mapping[str, Any]) -> Obj:
    """A PV's spec.claimRef naming this claim (with its UID and resourceVersion)."""
    md = claim["metadata"]
    return {
        "kind": "PersistentVolumeClaim",
        "apiVersion": "v1",
        "namespace": md["namespace"],
        "name": md["name"],
        "uid": md["uid"],
        "resourceVersion": md.get("resourceVersion", ""),
    }
