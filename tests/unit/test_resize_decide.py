"""The external-resizer's size decision and the resize status each step writes, as upstream's
expand-and-recover table has them."""

from __future__ import annotations

import grpc
import pytest

from controller_runtime import resize_status as rs
from controller_runtime.resize_status import is_final, is_infeasible
from external_resizer.controller import lease_name
from external_resizer.decide import Attempt, Sizes, target

G = 1 << 30
NOW = "2026-11-23T10:00:00Z"


def sizes(request: int, capacity: int, pv: int, allocated: int | None = None, status: str = "") -> Sizes:
    return Sizes(request, capacity, pv, allocated, status, fs_resize_pending=False)


@pytest.mark.parametrize(
    ("s", "final", "expected"),
    [
        # A first resize: the request, and a status to write.
        (sizes(2 * G, G, G), False, Attempt(2 * G, True)),
        # Uncertain outcome in flight: keep the allocated size even though the user asked for less.
        (sizes(3 * G, G, G, 5 * G, rs.CONTROLLER_IN_PROGRESS), False, Attempt(5 * G, False)),
        # ...but after a final error the user's (lowered) request wins.
        (sizes(3 * G, G, G, 5 * G, rs.CONTROLLER_IN_PROGRESS), True, Attempt(3 * G, True)),
        # Infeasible, then lowered: the new request, status rewritten.
        (sizes(2 * G, G, G, 100 * G, rs.CONTROLLER_INFEASIBLE), True, Attempt(2 * G, True)),
        # Infeasible and unchanged: the same size again (rate-limited by the caller).
        (sizes(100 * G, G, G, 100 * G, rs.CONTROLLER_INFEASIBLE), True, Attempt(100 * G, False)),
        # The node is finishing: nothing for the resizer.
        (sizes(2 * G, G, 2 * G, 2 * G, rs.NODE_PENDING), False, None),
        (sizes(2 * G, G, 2 * G, 2 * G, rs.NODE_IN_PROGRESS), False, None),
        # A bigger request while the node finishes the previous one: still the allocated size first.
        (sizes(4 * G, G, 2 * G, 2 * G, rs.NODE_PENDING), False, None),
        # The node said infeasible: the CSI resizer repeats the allocated size.
        (sizes(2 * G, G, 2 * G, 2 * G, rs.NODE_INFEASIBLE), False, Attempt(2 * G, False)),
        # PV already big enough, allocated set, no status (a crash after the PV write).
        (sizes(2 * G, G, 2 * G, 2 * G), False, Attempt(2 * G, False)),
    ],
)
def test_target_size(s: Sizes, final: bool, expected: Attempt | None) -> None:
    assert target(s, final, trivial=False) == expected


def test_trivial_resizer_follows_the_request_after_node_infeasible() -> None:
    assert target(sizes(3 * G, G, 5 * G, 5 * G, rs.NODE_INFEASIBLE), False, trivial=True) == Attempt(
        3 * G, True
    )


def test_error_classes() -> None:
    assert not is_final(grpc.StatusCode.DEADLINE_EXCEEDED) and not is_final(
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )
    assert not is_final(None)  # not a gRPC status: the operation may still be running
    assert is_final(grpc.StatusCode.INTERNAL) and not is_infeasible(grpc.StatusCode.INTERNAL)
    assert is_final(grpc.StatusCode.OUT_OF_RANGE) and is_infeasible(grpc.StatusCode.OUT_OF_RANGE)
    assert is_infeasible(grpc.StatusCode.INVALID_ARGUMENT) and is_infeasible(grpc.StatusCode.NOT_FOUND)


def test_status_through_a_controller_then_node_expansion() -> None:
    other = {"type": "ModifyingVolume", "status": "True"}
    start = {"phase": "Bound", "capacity": {"storage": "1Gi"}, "conditions": [other]}
    s1 = rs.in_progress(start, "2Gi", True, NOW)
    assert s1["allocatedResources"] == {"storage": "2Gi"}
    assert s1["allocatedResourceStatuses"] == {"storage": rs.CONTROLLER_IN_PROGRESS}
    assert [c["type"] for c in s1["conditions"]] == ["ModifyingVolume", rs.RESIZING]
    s2 = rs.node_expansion_pending(s1, NOW)
    assert s2["allocatedResourceStatuses"] == {"storage": rs.NODE_PENDING}
    assert [c["type"] for c in s2["conditions"]] == ["ModifyingVolume", rs.RESIZING, rs.FS_RESIZE_PENDING]
    assert s2["conditions"][-1]["message"] == (
        "Waiting for user to (re-)start a pod to finish file system resize of volume on node."
    )
    s3 = rs.finished(rs.node_in_progress(s2), "2Gi")
    assert s3["capacity"] == {"storage": "2Gi"} and s3["allocatedResourceStatuses"] == {}
    assert s3["conditions"] == [other] and s3["allocatedResources"] == {"storage": "2Gi"}
    patch = rs.status_patch(s2, s3)
    assert patch["allocatedResourceStatuses"] == {"storage": None}  # merge patch: the key goes
    assert patch["capacity"] == {"storage": "2Gi"} and patch["conditions"] == [other]
    assert "allocatedResources" not in patch


def test_controller_failure_marks() -> None:
    start = rs.in_progress({"capacity": {"storage": "1Gi"}}, "100Gi", True, NOW)
    failed = rs.controller_failed(
        start, "failed to expand pvc with rpc error: code = OutOfRange desc = x", True, NOW
    )
    assert failed["allocatedResourceStatuses"] == {"storage": rs.CONTROLLER_INFEASIBLE}
    assert [c["type"] for c in failed["conditions"]] == [rs.RESIZING, rs.CONTROLLER_RESIZE_ERROR]
    kept = rs.controller_failed(start, "failed", False, NOW)
    assert kept["allocatedResourceStatuses"] == {"storage": rs.CONTROLLER_IN_PROGRESS}
    # A lowered request starts over: only Resizing stays.
    again = rs.in_progress(failed, "2Gi", True, NOW)
    assert [c["type"] for c in again["conditions"]] == [rs.RESIZING]


def test_lease_name() -> None:
    assert lease_name("loop.csi.kubeloop.dev") == "external-resizer-loop-csi-kubeloop-dev"
    assert lease_name("a.b/") == "external-resizer-a-b-X"
