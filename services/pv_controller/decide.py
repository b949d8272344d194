"""Pure decisions of the binder: what a volume or a bound claim needs, how a reclaim goes, and the
exact object each of the bind's four writes sends. The controller looks objects up (cache, then
API), asks these functions, and performs the writes they describe."""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controller_runtime import storage
from controller_runtime.kinds import PersistentVolume, PersistentVolumeClaim, StorageClass, pod_view
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import Obj
from controller_runtime.volumes import pod_terminated

from . import names
from .match import is_bound_to_claim, volume_mode_mismatch


def writable(obj: Mapping[str, Any]) -> Obj:
    """A copy of a cached object that the bind writes may modify: the containers they touch
    (metadata, annotations, spec, status) are new; everything else is shared with the cache and
    left alone. Far cheaper than a deep copy, which dominated the CPU of a bind."""
    md = dict(obj.get("metadata") or {})
    if md.get("annotations") is not None:
        md["annotations"] = dict(md["annotations"])
    return {
        **obj,
        "metadata": md,
        "spec": dict(obj.get("spec") or {}),
        "status": dict(obj.get("status") or {}),
    }


def _annotations(obj: PersistentVolume | PersistentVolumeClaim) -> dict[str, str]:
    return dict(obj.get("metadata", {}).get("annotations") or {})


def has_annotation(obj: PersistentVolume | PersistentVolumeClaim, key: str) -> bool:
    return key in (obj.get("metadata", {}).get("annotations") or {})


def phase_of(obj: PersistentVolume | PersistentVolumeClaim) -> str:
    return str(obj.get("status", {}).get("phase") or "")


# -- volumes -------------------------------------------------------------------------------------------


class VolumeAction(enum.Enum):
    AVAILABLE = "available"  # unused: make it Available
    PREBOUND = "prebound"  # reserved for a claim by name only: Available, and sync that claim
    RELEASE = "release"  # its claim is gone: Released, then reclaim per policy
    MODE_MISMATCH = "mode-mismatch"  # claim points nowhere yet, but the volumeMode can never fit
    SYNC_CLAIM = "sync-claim"  # claim not yet pointing here: the claim's sync finishes the bind
    BOUND = "bound"  # claim and volume point at each other: Bound
    RELEASE_PROVISIONED = "release-provisioned"  # claim bound elsewhere, a provisioned Delete volume
    UNBIND = "unbind"  # claim bound elsewhere: undo our binding, or drop the UID of a user's one


def decide_volume(volume: PersistentVolume, claim: PersistentVolumeClaim | None) -> VolumeAction:
    """`claim` is the claim the claimRef names, already verified against the API, and None when it
    is gone or has another UID."""
    spec = volume.get("spec", {})
    ref = spec.get("claimRef")
    if not ref:
        return VolumeAction.AVAILABLE
    if not ref.get("uid"):
        return VolumeAction.PREBOUND
    if claim is None:
        return VolumeAction.RELEASE
    volume_name = claim.get("spec", {}).get("volumeName") or ""
    if not volume_name:
        if volume_mode_mismatch(claim, volume):
            return VolumeAction.MODE_MISMATCH
        return VolumeAction.SYNC_CLAIM
    if volume_name == volume["metadata"]["name"]:
        return VolumeAction.BOUND
    if (
        has_annotation(volume, storage.ANN_PROVISIONED_BY)
        and spec.get("persistentVolumeReclaimPolicy") == storage.DELETE
    ):
        return VolumeAction.RELEASE_PROVISIONED
    return VolumeAction.UNBIND


class ReclaimAction(enum.Enum):
    NONE = "none"  # Retain, or the volume was migrated: nothing for us to do
    EXTERNAL_DELETE = "external-delete"  # its external provisioner deletes it; we leave it Released
    FAILED_DELETE = "failed-delete"  # Delete, but nobody can delete it
    RECYCLE_UNSUPPORTED = "recycle-unsupported"
    UNKNOWN_POLICY = "unknown-policy"


@dataclass(frozen=True)
class Reclaim:
    action: ReclaimAction
    message: str = ""


def decide_reclaim(volume: PersistentVolume) -> Reclaim:
    if _annotations(volume).get(storage.ANN_MIGRATED_TO):
        return Reclaim(ReclaimAction.NONE)  # the CSI provisioner owns migrated volumes
    policy = volume.get("spec", {}).get("persistentVolumeReclaimPolicy") or ""
    if policy == storage.RETAIN:
        return Reclaim(ReclaimAction.NONE)
    if policy == storage.RECYCLE:
        return Reclaim(ReclaimAction.RECYCLE_UNSUPPORTED, names.MSG_NO_RECYCLER)
    if policy == storage.DELETE:
        provisioner = _annotations(volume).get(storage.ANN_PROVISIONED_BY, "")
        # kubeloop has no in-tree volume plugins: only an external provisioner can delete. Like
        # kcm (HonorPVReclaimPolicy), a CSI volume without the annotation is left to an external
        # deleter too, and stays Released.
        if provisioner and not provisioner.startswith("kubernetes.io/"):
            return Reclaim(ReclaimAction.EXTERNAL_DELETE)
        if not provisioner and volume.get("spec", {}).get("csi"):
            return Reclaim(ReclaimAction.EXTERNAL_DELETE)
        return Reclaim(
            ReclaimAction.FAILED_DELETE,
            f'error getting deleter volume plugin for volume "{volume["metadata"]["name"]}": '
            "no deletable volume plugin matched",
        )
    return Reclaim(ReclaimAction.UNKNOWN_POLICY, names.MSG_UNKNOWN_RECLAIM_POLICY)


@dataclass
class OperationBackoff:
    """kcm runs a delete as an operation that, once failed, may not run again before a delay that
    starts at 0.5 s and doubles up to 2 min 2 s (goroutinemap's exponential backoff); a delete
    that cannot succeed is retried, and counted, no more often than that. Times are monotonic
    seconds, passed in."""

    initial: float = 0.5
    maximum: float = 122.0
    _state: dict[str, tuple[float, float]] = field(default_factory=dict)  # key -> (failed at, delay)

    def ready(self, key: str, now: float) -> bool:
        state = self._state.get(key)
        return state is None or now - state[0] > state[1]

    def failed(self, key: str, now: float) -> None:
        state = self._state.get(key)
        delay = self.initial if state is None else min(self.maximum, state[1] * 2)
        self._state[key] = (now, delay)

    def forget(self, key: str) -> None:
        self._state.pop(key, None)


def volume_released(volume: PersistentVolume, claim: PersistentVolumeClaim | None) -> bool:
    """Whether a Delete reclaim may proceed: the claimRef's claim is gone, has another UID, or is
    bound to another volume. `claim` is the claim named by the claimRef as cached, or None."""
    ref = volume.get("spec", {}).get("claimRef")
    if not ref or not ref.get("uid"):
        return False
    if claim is None or claim.get("metadata", {}).get("uid") != ref.get("uid"):
        return True
    bound_to = claim.get("spec", {}).get("volumeName") or ""
    return bool(bound_to) and bound_to != volume["metadata"]["name"]


# -- bound claims ------------------------------------------------------------------------------------


class BoundClaimAction(enum.Enum):
    LOST_REFERENCE = "lost-reference"  # volumeName cleared after the bind completed
    LOST_VOLUME = "lost-volume"  # its volume is gone
    BIND = "bind"  # volume unbound (re-bind) or correctly bound (finish any missing write)
    MISBOUND = "misbound"  # the volume belongs to another claim UID


def decide_bound_claim(claim: PersistentVolumeClaim, volume: PersistentVolume | None) -> BoundClaimAction:
    if not claim.get("spec", {}).get("volumeName"):
        return BoundClaimAction.LOST_REFERENCE
    if volume is None:
        return BoundClaimAction.LOST_VOLUME
    ref = volume.get("spec", {}).get("claimRef")
    if not ref or ref.get("uid") == claim.get("metadata", {}).get("uid"):
        return BoundClaimAction.BIND
    return BoundClaimAction.MISBOUND


# -- the four writes of a bind ------------------------------------------------------------------------


def volume_bound_to_claim(volume: PersistentVolume, claim: PersistentVolumeClaim) -> Obj | None:
    """Write 1: the volume with claimRef set to the claim (and bound-by-controller when the link is
    ours, not the user's), or None when it already is."""
    by_controller = not is_bound_to_claim(volume, claim)
    ref = volume.get("spec", {}).get("claimRef") or {}
    md = claim["metadata"]
    set_ref = (
        ref.get("name") != md["name"]
        or ref.get("namespace") != md["namespace"]
        or ref.get("uid") != md["uid"]
    )
    set_annotation = by_controller and not has_annotation(volume, storage.ANN_BOUND_BY_CONTROLLER)
    if not (set_ref or set_annotation):
        return None
    new = writable(volume)
    if set_ref:
        new["spec"]["claimRef"] = storage.claim_reference(claim)
    if set_annotation:
        new["metadata"]["annotations"] = {
            **(new["metadata"].get("annotations") or {}),
            storage.ANN_BOUND_BY_CONTROLLER: storage.YES,
        }
    return new


def volume_with_phase(volume: PersistentVolume, phase: str, message: str = "") -> Obj | None:
    """Writes 2 (and every other phase change): the volume's status, or None when unchanged.
    lastPhaseTransitionTime is left as read: the apiserver's status strategy stamps it when the
    phase changes and the client did not change it, as it does for kcm's writes."""
    if phase_of(volume) == phase:
        return None
    new = writable(volume)
    status = new["status"]
    status["phase"] = phase
    if message:
        status["message"] = message
    else:
        status.pop("message", None)
    return new


def claim_bound_to_volume(claim: PersistentVolumeClaim, volume: PersistentVolume) -> Obj | None:
    """Write 3: spec.volumeName, bound-by-controller when the user had not named the volume, and
    bind-completed; None when all are already set."""
    name = volume["metadata"]["name"]
    by_controller = claim.get("spec", {}).get("volumeName") != name
    ann = _annotations(claim)
    wanted = dict(ann)
    if by_controller and storage.ANN_BOUND_BY_CONTROLLER not in wanted:
        wanted[storage.ANN_BOUND_BY_CONTROLLER] = storage.YES
    wanted.setdefault(storage.ANN_BIND_COMPLETED, storage.YES)
    if not by_controller and wanted == ann:
        return None
    new = writable(claim)
    new["spec"]["volumeName"] = name
    new["metadata"]["annotations"] = wanted
    return new


def claim_with_status(
    claim: PersistentVolumeClaim, phase: str, volume: PersistentVolume | None
) -> Obj | None:
    """Write 4 (and Pending/Lost): phase, plus access modes and capacity from the volume when it
    becomes Bound; None when unchanged. Capacity is only copied on the transition: a later
    difference can be a filesystem resize in progress and must not be clobbered."""
    status = claim.get("status", {})
    new_status = dict(status)
    dirty = False
    if status.get("phase") != phase:
        new_status["phase"] = phase
        dirty = True
    if volume is None:
        for key in ("accessModes", "capacity"):
            if status.get(key) is not None:
                new_status.pop(key)
                dirty = True
        # Dropped with whatever else changes, but no reason to write on its own (as kcm).
        new_status.pop("currentVolumeAttributesClassName", None)
    else:
        vspec = volume.get("spec", {})
        if status.get("accessModes") != vspec.get("accessModes"):
            new_status["accessModes"] = copy.deepcopy(vspec.get("accessModes"))
            dirty = True
        if status.get("phase") != phase:
            capacity = vspec.get("capacity") or {}
            pre_resize = _annotations(volume).get(names.ANN_PRE_RESIZE_CAPACITY)
            if pre_resize is not None:
                # The volume was expanded but its filesystem not yet: report the size before the
                # expansion, so that the node still grows the filesystem (kcm does the same; an
                # unparsable value falls back to the volume's capacity).
                size = pre_resize if parse_quantity(pre_resize) > 0 else capacity.get("storage")
                new_status["capacity"] = {**(status.get("capacity") or {}), "storage": size}
                dirty = True
            elif (status.get("capacity") or {}).get("storage") != capacity.get("storage"):
                new_status["capacity"] = copy.deepcopy(capacity)
                dirty = True
        # The class the volume has when the claim first binds; after that only the external-resizer
        # changes it (kcm sets it here and nowhere else, so the two never race).
        vac = vspec.get("volumeAttributesClassName")
        binds = status.get("phase") == storage.CLAIM_PENDING and phase == storage.CLAIM_BOUND
        if binds and status.get("currentVolumeAttributesClassName") != vac:
            if vac is None:
                new_status.pop("currentVolumeAttributesClassName", None)
            else:
                new_status["currentVolumeAttributesClassName"] = vac
            dirty = True
    if not dirty:
        return None
    new = writable(claim)
    new["status"] = new_status
    return new


def claim_lost(claim: PersistentVolumeClaim) -> Obj | None:
    """The claim marked Lost, without access modes and capacity; None when it already is Lost. As
    kcm's updateClaimStatusWithEvent: a claim already in the phase is not touched at all, whatever
    else its status says (and no second event is recorded)."""
    if phase_of(claim) == storage.CLAIM_LOST:
        return None
    return claim_with_status(claim, storage.CLAIM_LOST, None)


def volume_unbound(volume: PersistentVolume) -> Obj:
    """Undo a binding: ours goes entirely (claimRef and annotation); a user's keeps its claimRef
    minus the UID, so the volume stays reserved for that claim name."""
    new = writable(volume)
    ann = new["metadata"].get("annotations") or {}
    if storage.ANN_BOUND_BY_CONTROLLER in ann:
        new["spec"].pop("claimRef", None)
        del ann[storage.ANN_BOUND_BY_CONTROLLER]
        new["metadata"]["annotations"] = ann or None
    else:
        new["spec"]["claimRef"] = {k: v for k, v in new["spec"]["claimRef"].items() if k != "uid"}
    return new


def claim_with_provisioner(claim: PersistentVolumeClaim, provisioner: str) -> Obj | None:
    """The claim handed to an external provisioner (both annotation keys), or None when it is."""
    ann = _annotations(claim)
    if (
        ann.get(storage.ANN_STORAGE_PROVISIONER) == provisioner
        and ann.get(storage.ANN_BETA_STORAGE_PROVISIONER) == provisioner
    ):
        return None
    new = writable(claim)
    new_ann = new["metadata"].setdefault("annotations", {})
    new_ann[storage.ANN_STORAGE_PROVISIONER] = provisioner
    new_ann[storage.ANN_BETA_STORAGE_PROVISIONER] = provisioner
    return new


def unscheduled_pods(pods: Iterable[Obj]) -> list[str]:
    """Names of the pods using a claim that still wait for a node, for the WaitForPodScheduled
    event; finished pods wait for nothing (kcm's findNonScheduledPodsByPVC skips them too)."""
    return sorted(
        str(p["metadata"]["name"])
        for p in pods
        if not p.get("spec", {}).get("nodeName") and not pod_terminated(pod_view(p))
    )


class BindingModeUnset(Exception):
    """The claim's StorageClass has no volumeBindingMode (the apiserver defaults it, so only a class
    that bypassed defaulting gets here): kcm fails the claim's sync with this message and retries."""


def is_delay_binding(class_name: str, storage_class: StorageClass | None) -> bool:
    """WaitForFirstConsumer class; no class or a missing one binds immediately (a missing one fails
    at provisioning); a class without a binding mode is an error."""
    if not class_name or storage_class is None:
        return False
    mode = storage_class.get("volumeBindingMode")
    if mode is None:
        raise BindingModeUnset(f'VolumeBindingMode not set for StorageClass "{class_name}"')
    return bool(mode == "WaitForFirstConsumer")


def provisioning_error(claim_class_name: str, storage_class: StorageClass | None) -> str | None:
    """Why a claim of this class cannot be handed to an external provisioner, as kcm words it."""
    if storage_class is None:
        return f'storageclass.storage.k8s.io "{claim_class_name}" not found'
    provisioner = str(storage_class.get("provisioner") or "")
    if provisioner == storage.NO_PROVISIONER or provisioner.startswith("kubernetes.io/"):
        return f"no volume plugin matched name: {provisioner}"
    return None
