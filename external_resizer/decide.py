"""The external-resizer's own decisions as pure functions: what size an attempt works towards
(recovery from expansion failure, GA since Kubernetes 1.34), how a CSI error is classified,
which volumes a resizer in node deployment serves, and for the modify controller
(VolumeAttributesClass, GA since 1.34) what step a claim's class change takes and the status it
writes. The status each step writes, and which CSI
errors are final, are controller_runtime.resize_status, shared with the node side."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from controller_runtime.kinds import ModifyVolumeStatus, Node, PersistentVolume, PersistentVolumeClaim
from controller_runtime.node_affinity import required_affinity, selector_matches
from controller_runtime.resize_status import (
    CONTROLLER_IN_PROGRESS,
    CONTROLLER_INFEASIBLE,
    NODE_IN_PROGRESS,
    NODE_INFEASIBLE,
    NODE_PENDING,
)
from controller_runtime.resources import Obj

# Event reasons and the messages external-resizer writes with them.
EVENT_RESIZING = "Resizing"
EVENT_RESIZE_FAILED = "VolumeResizeFailed"
EVENT_RESIZE_SUCCESSFUL = "VolumeResizeSuccessful"
EVENT_FS_RESIZE_REQUIRED = "FileSystemResizeRequired"
MSG_FS_RESIZE_REQUIRED = "Require file system resize of volume on node"
MSG_RESIZE_SUCCEEDED = "Resize volume succeeded"


@dataclass(frozen=True)
class Sizes:
    """The sizes and status of one claim, in bytes; `allocated` is None when never set."""

    request: int
    capacity: int  # status.capacity
    pv: int  # the PV's spec.capacity
    allocated: int | None
    resize_status: str  # allocatedResourceStatuses["storage"], "" when absent
    fs_resize_pending: bool


@dataclass(frozen=True)
class Attempt:
    size: int
    # False when the attempt repeats the size already recorded as allocated: the status (and its
    # conditions) stays as it is apart from a fresh Resizing condition.
    update_status: bool


def target(s: Sizes, final_error: bool, trivial: bool) -> Attempt | None:
    """The size the next attempt works towards, or None when there is nothing for the resizer to
    do (the node side is finishing). An in-flight size whose outcome is uncertain is kept until it
    resolves; after a final error the user's current request wins."""
    rs, alloc = s.resize_status, s.allocated
    size: int
    if s.pv < s.request:
        if rs == NODE_INFEASIBLE:
            size = alloc if alloc is not None else s.request
        elif rs in (NODE_PENDING, NODE_IN_PROGRESS):
            size = alloc if alloc is not None else s.request
            if s.pv >= size:
                return None
        elif rs == CONTROLLER_IN_PROGRESS:
            size = s.request if final_error or alloc is None else alloc
        else:
            size = s.request
    else:
        if rs in (NODE_IN_PROGRESS, NODE_PENDING):
            return None
        if rs == NODE_INFEASIBLE:
            size = alloc if alloc is not None and not trivial else s.request
        elif rs in (CONTROLLER_IN_PROGRESS, CONTROLLER_INFEASIBLE):
            size = alloc if alloc is not None else s.request
        elif alloc is not None:
            size = alloc
        elif s.fs_resize_pending:
            return None
        else:
            size = s.request
    return Attempt(size, update_status=alloc != size)


def served_by_node(pv: PersistentVolume, node: Node | None) -> bool:
    """Whether a resizer in node deployment (`node`: its own Node, None while it has none) expands
    this PV: only when the PV's required node affinity is satisfied by that Node's labels (or
    name). A PV without a required affinity is reachable everywhere, so every node's resizer
    would expand it at once: none does (a resizer without --node-deployment serves those)."""
    required = required_affinity(pv)
    return node is not None and required is not None and selector_matches(required, node)


# -- modifying a volume's attributes (VolumeAttributesClass) ---------------------------------------

MODIFYING_VOLUME = "ModifyingVolume"
MODIFY_VOLUME_ERROR = "ModifyVolumeError"
MODIFY_PENDING = "Pending"
MODIFY_IN_PROGRESS = "InProgress"
MODIFY_INFEASIBLE = "Infeasible"
EVENT_VOLUME_MODIFY = "VolumeModify"
EVENT_MODIFY_FAILED = "VolumeModifyFailed"
EVENT_MODIFY_SUCCESSFUL = "VolumeModifySuccessful"
EVENT_MODIFY_CANCELED = "VolumeModifyCanceled"
MSG_MODIFY_CANCELED = "Cancelled modify."


class Step(enum.Enum):
    NONE = "none"  # the claim's volume has the class it asks for
    CANCEL = "cancel"  # the claim asks for no class: a modification still shown is cancelled
    CONTINUE = "continue"  # the driver may still be modifying towards the recorded target: repeat it
    MODIFY = "modify"  # modify towards the class the claim asks for


@dataclass(frozen=True)
class ModifyPlan:
    step: Step
    target: str = ""  # the class to modify to (CONTINUE, MODIFY)


def _modify_status(claim: PersistentVolumeClaim) -> ModifyVolumeStatus | None:
    return (claim.get("status") or {}).get("modifyVolumeStatus")


def modify_plan(claim: PersistentVolumeClaim, uncertain: bool) -> ModifyPlan:
    """What the modify controller does for a bound claim of its driver. `uncertain`: the last
    ControllerModifyVolume for it failed in a way that leaves it possibly still running, so its
    target is kept whatever the claim now asks (changing course mid-modification could leave the
    volume between two classes)."""
    wanted = (claim.get("spec") or {}).get("volumeAttributesClassName") or ""
    current = (claim.get("status") or {}).get("currentVolumeAttributesClassName") or ""
    status = _modify_status(claim)
    if status is None and wanted == current:
        return ModifyPlan(Step.NONE)
    in_progress = status is not None and status.get("status") == MODIFY_IN_PROGRESS
    if not wanted and not in_progress:
        return ModifyPlan(Step.CANCEL)
    if (in_progress and uncertain) or not wanted:
        assert status is not None
        return ModifyPlan(Step.CONTINUE, str(status.get("targetVolumeAttributesClassName") or ""))
    return ModifyPlan(Step.MODIFY, wanted)


def retried_slowly(claim: PersistentVolumeClaim) -> bool:
    """Whether an Infeasible result still stands for what the claim asks: its recorded target is
    the class in its spec. A claim that asks for another class (or none) is tried at once."""
    status = _modify_status(claim)
    wanted = (claim.get("spec") or {}).get("volumeAttributesClassName")
    return (
        status is not None and wanted is not None and status.get("targetVolumeAttributesClassName") == wanted
    )


def infeasible(claim: PersistentVolumeClaim) -> bool:
    status = _modify_status(claim)
    return status is not None and status.get("status") == MODIFY_INFEASIBLE


def _merged(claim: PersistentVolumeClaim, condition: Obj) -> Obj:
    """external-resizer's MergePVCConditions for one condition: the transition time moves only
    when the reason or status changes."""
    for old in (claim.get("status") or {}).get("conditions") or []:
        if old.get("type") == condition["type"]:
            if old.get("reason") == condition.get("reason") and old.get("status") == condition["status"]:
                return {**condition, "lastTransitionTime": old.get("lastTransitionTime")}
            break
    return {**condition, "lastTransitionTime": condition["lastProbeTime"]}


@dataclass(frozen=True)
class ModifyFailure:
    code: str  # as Go prints a gRPC code: the ModifyVolumeError condition's reason
    message: str  # the driver's message
    final: bool  # the driver certainly stopped


def modify_status_patch(
    claim: PersistentVolumeClaim, state: str, now: str, failure: ModifyFailure | None = None
) -> Obj:
    """The strategic merge patch of the claim's status that marks a modification Pending,
    InProgress or Infeasible (upstream's markControllerModifyVolumeStatus). Pending says only that;
    InProgress without a failure starts a modification towards the class the claim asks for; with
    a failure the target stays and the error is shown."""
    status = dict(_modify_status(claim) or {})
    status["status"] = state
    patch: Obj = {"modifyVolumeStatus": status}
    if state == MODIFY_PENDING:
        return patch
    target = str(status.get("targetVolumeAttributesClassName") or "")
    conditions: list[Obj] = []
    modifying: Obj = {"type": MODIFYING_VOLUME, "status": "True", "lastProbeTime": now}
    if failure is None:
        target = (claim.get("spec") or {}).get("volumeAttributesClassName") or ""
        status["targetVolumeAttributesClassName"] = target
        modifying["message"] = f'Modifying volume to "{target}" is in progress.'
    else:
        outcome = "failed. Waiting for retry" if failure.final else "is still in progress"
        modifying["message"] = f'Modifying volume to "{target}" {outcome}.'
        error: Obj = {
            "type": MODIFY_VOLUME_ERROR,
            "status": "True",
            "reason": failure.code,
            "message": failure.message,
            "lastProbeTime": now,
        }
        conditions.append(_merged(claim, error))
    patch["conditions"] = [_merged(claim, modifying), *conditions]
    return patch


def _without(claim: PersistentVolumeClaim, kinds: tuple[str, ...]) -> list[Obj]:
    """Strategic merge directives deleting the claim's conditions of these types."""
    present = {c.get("type") for c in (claim.get("status") or {}).get("conditions") or []}
    return [{"type": kind, "$patch": "delete"} for kind in kinds if kind in present]


def modify_completed_patch(claim: PersistentVolumeClaim, target: str) -> Obj:
    """The claim's status once the driver has the target class: current, no modification, no
    modify conditions."""
    patch: Obj = {"modifyVolumeStatus": None, "currentVolumeAttributesClassName": target}
    if deleted := _without(claim, (MODIFYING_VOLUME, MODIFY_VOLUME_ERROR)):
        patch["conditions"] = deleted
    return patch


def cancel_patch(claim: PersistentVolumeClaim) -> Obj | None:
    """A cancelled modification loses its ModifyingVolume condition and keeps the rest (the last
    result stays on record); None when there is none to cancel."""
    deleted = _without(claim, (MODIFYING_VOLUME,))
    return {"conditions": deleted} if deleted else None
