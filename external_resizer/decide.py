"""The external-resizer's own decisions as pure functions: what size an attempt works towards
(recovery from expansion failure, GA since Kubernetes 1.34), how a CSI error is classified, and
which volumes a resizer in node deployment serves. The status each step writes, and which CSI
errors are final, are controller_runtime.resize_status, shared with the node side."""

from __future__ import annotations

from dataclasses import dataclass

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


def served_by_node(pv: Obj, node: Obj | None) -> bool:
    """Whether a resizer in node deployment (`node`: its own Node, None while it has none) expands
    this PV: only when the PV's required node affinity is satisfied by that Node's labels (or
    name). A PV without a required affinity is reachable everywhere, so every node's resizer
    would expand it at once: none does (a resizer without --node-deployment serves those)."""
    required = required_affinity(pv)
    return node is not None and required is not None and selector_matches(required, node)
