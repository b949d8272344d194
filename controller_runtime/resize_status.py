"""A PersistentVolumeClaim's resize status, the part of the API the external-resizer and the node
side (kubelet, here the node agent) share: the condition types and allocatedResourceStatuses values
(see docs/contracts.md), and the status each step of an expansion writes, as pure functions."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import grpc

from .csi_errors import EXPAND_VOLUME, OperationState, classify
from .kinds import PersistentVolumeClaim
from .resources import Obj

# status.conditions[].type values the resize path owns; any other condition is always kept.
RESIZING = "Resizing"
FS_RESIZE_PENDING = "FileSystemResizePending"
CONTROLLER_RESIZE_ERROR = "ControllerResizeError"
NODE_RESIZE_ERROR = "NodeResizeError"
RESIZE_CONDITIONS = (RESIZING, FS_RESIZE_PENDING, CONTROLLER_RESIZE_ERROR, NODE_RESIZE_ERROR)

# status.allocatedResourceStatuses["storage"] values.
CONTROLLER_IN_PROGRESS = "ControllerResizeInProgress"
CONTROLLER_INFEASIBLE = "ControllerResizeInfeasible"
NODE_PENDING = "NodeResizePending"
NODE_IN_PROGRESS = "NodeResizeInProgress"
NODE_INFEASIBLE = "NodeResizeInfeasible"

MSG_FS_RESIZE_PENDING = "Waiting for user to (re-)start a pod to finish file system resize of volume on node."

# Annotations.
RESIZER_ANNOTATION = "volume.kubernetes.io/storage-resizer"
NODE_EXPANSION_NOT_REQUIRED = "volume.kubernetes.io/node-expansion-not-required"
# On a PV whose volume grew while its filesystem has not yet: the claim's capacity before the
# resize. The external-resizer sets and removes it; kcm's binder and expander read it.
PRE_RESIZE_CAPACITY = "volume.alpha.kubernetes.io/pre-resize-capacity"


def is_final(code: grpc.StatusCode | None) -> bool:
    """Whether an expansion (ControllerExpandVolume, NodeExpandVolume) that failed with `code` has
    certainly stopped; None stands for an error that is not a gRPC status, never final."""
    return classify(EXPAND_VOLUME, code).final


def is_infeasible(code: grpc.StatusCode | None) -> bool:
    """Whether the size can never be had: the user must ask for another."""
    return classify(EXPAND_VOLUME, code) is OperationState.INFEASIBLE


def resize_status(claim: PersistentVolumeClaim) -> str:
    """allocatedResourceStatuses["storage"], "" when no resize is in progress."""
    return str(((claim.get("status") or {}).get("allocatedResourceStatuses") or {}).get("storage") or "")


def has_condition(claim: PersistentVolumeClaim, kind: str) -> bool:
    return any(
        c.get("type") == kind and c.get("status") == "True"
        for c in (claim.get("status") or {}).get("conditions") or []
    )


def _copy(status: Mapping[str, Any]) -> Obj:
    """A deep copy of a claim's status (a typed view or a plain dict) to build the next one from."""
    return dict(copy.deepcopy(status))


def _condition(kind: str, now: str, message: str = "") -> Obj:
    cond: Obj = {"type": kind, "status": "True", "lastProbeTime": None, "lastTransitionTime": now}
    if message:
        cond["message"] = message
    return cond


def _conditions(status: Mapping[str, Any], drop: tuple[str, ...], add: list[Obj]) -> list[Obj]:
    kinds = {c["type"] for c in add}
    kept = [
        c for c in status.get("conditions") or [] if c.get("type") not in drop and c.get("type") not in kinds
    ]
    return kept + add


def _with_resize_status(status: Mapping[str, Any], value: str | None) -> Obj:
    statuses = dict(status.get("allocatedResourceStatuses") or {})
    if value is None:
        statuses.pop("storage", None)
    else:
        statuses["storage"] = value
    return statuses


def in_progress(status: Mapping[str, Any], size_text: str, update_status: bool, now: str) -> Obj:
    """Step 1 of a controller attempt: Resizing, and the size worked towards. `update_status` False
    repeats an attempt at the allocated size: the other resize conditions and status stay."""
    new = _copy(status)
    if update_status:
        new["conditions"] = _conditions(status, RESIZE_CONDITIONS, [_condition(RESIZING, now)])
        new["allocatedResourceStatuses"] = _with_resize_status(status, CONTROLLER_IN_PROGRESS)
    else:
        new["conditions"] = _conditions(status, (), [_condition(RESIZING, now)])
    new["allocatedResources"] = {**(status.get("allocatedResources") or {}), "storage": size_text}
    return new


def controller_failed(status: Mapping[str, Any], message: str, infeasible: bool, now: str) -> Obj:
    new = _copy(status)
    new["conditions"] = _conditions(status, (), [_condition(CONTROLLER_RESIZE_ERROR, now, message)])
    if infeasible:
        new["allocatedResourceStatuses"] = _with_resize_status(status, CONTROLLER_INFEASIBLE)
    return new


def node_expansion_pending(status: Mapping[str, Any], now: str) -> Obj:
    new = _copy(status)
    pending = _condition(FS_RESIZE_PENDING, now, MSG_FS_RESIZE_PENDING)
    new["conditions"] = _conditions(status, (), [pending])
    new["allocatedResourceStatuses"] = _with_resize_status(status, NODE_PENDING)
    return new


def finished(status: Mapping[str, Any], capacity_text: str) -> Obj:
    """The resizer's end when no node expansion is needed, and the node side's after it."""
    new = _copy(status)
    new["capacity"] = {**(status.get("capacity") or {}), "storage": capacity_text}
    new["conditions"] = _conditions(status, RESIZE_CONDITIONS, [])
    new["allocatedResourceStatuses"] = _with_resize_status(status, None)
    return new


def status_patch(old: Mapping[str, Any], new: Obj) -> Obj:
    """A JSON merge patch turning status `old` into `new` for the keys the resize path owns: lists
    are replaced whole, and a map key that went away is sent as null."""
    patch: Obj = {}
    for key in ("conditions", "capacity", "allocatedResources", "allocatedResourceStatuses"):
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if isinstance(before, dict) and isinstance(after, dict):
            patch[key] = {
                k: after.get(k) for k in before.keys() | after.keys() if before.get(k) != after.get(k)
            }
        else:
            patch[key] = after
    return patch


def node_in_progress(status: Mapping[str, Any]) -> Obj:
    new = _copy(status)
    new["allocatedResourceStatuses"] = _with_resize_status(status, NODE_IN_PROGRESS)
    return new


def node_failed(status: Mapping[str, Any], message: str, infeasible: bool, now: str) -> Obj:
    new = _copy(status)
    new["conditions"] = _conditions(status, (), [_condition(NODE_RESIZE_ERROR, now, message)])
    if infeasible:
        new["allocatedResourceStatuses"] = _with_resize_status(status, NODE_INFEASIBLE)
    return new
