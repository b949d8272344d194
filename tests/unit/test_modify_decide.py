"""The modify controller's pure decisions (external_resizer.decide): which step a claim takes, when
an Infeasible class is held back, and the status each mark writes, as external-resizer's
pkg/modifycontroller decides them."""

from __future__ import annotations

from typing import Any

import pytest

from controller_runtime.kinds import PersistentVolumeClaim, pvc_view
from controller_runtime.resources import Obj
from external_resizer.decide import (
    ModifyFailure,
    ModifyPlan,
    Step,
    cancel_patch,
    modify_completed_patch,
    modify_plan,
    modify_status_patch,
    retried_slowly,
)

NOW = "2026-11-27T02:00:00Z"


def pvc(
    spec: str | None, current: str | None = None, status: str | None = None, target: str = "", **st: Any
) -> PersistentVolumeClaim:
    claim: Obj = {"metadata": {"name": "c"}, "spec": {}, "status": {"phase": "Bound", **st}}
    if spec is not None:
        claim["spec"]["volumeAttributesClassName"] = spec
    if current is not None:
        claim["status"]["currentVolumeAttributesClassName"] = current
    if status is not None:
        claim["status"]["modifyVolumeStatus"] = {"status": status, "targetVolumeAttributesClassName": target}
    return pvc_view(claim)


@pytest.mark.parametrize(
    ("claim", "uncertain", "plan"),
    [
        (pvc("gold", "gold"), False, ModifyPlan(Step.NONE)),
        (pvc(None), False, ModifyPlan(Step.NONE)),
        # First time: the class set after binding (current empty) is applied.
        (pvc("gold"), False, ModifyPlan(Step.MODIFY, "gold")),
        (pvc("gold", "silver"), False, ModifyPlan(Step.MODIFY, "gold")),
        # Infeasible or Pending, then back to the current class: modified back (the rollback).
        (pvc("silver", "silver", "Infeasible", "bad"), False, ModifyPlan(Step.MODIFY, "silver")),
        (pvc("silver", "silver", "Pending"), False, ModifyPlan(Step.MODIFY, "silver")),
        # A call that may still run keeps its target whatever the claim asks now.
        (pvc("gold", "silver", "InProgress", "bronze"), True, ModifyPlan(Step.CONTINUE, "bronze")),
        (pvc("gold", "silver", "InProgress", "bronze"), False, ModifyPlan(Step.MODIFY, "gold")),
        # No class asked: cancel, unless a modification is in progress, which goes on.
        (pvc("", None, "Infeasible", "bad"), False, ModifyPlan(Step.CANCEL)),
        (pvc(None, None, "InProgress", "bronze"), False, ModifyPlan(Step.CONTINUE, "bronze")),
    ],
)
def test_modify_plan(claim: PersistentVolumeClaim, uncertain: bool, plan: ModifyPlan) -> None:
    assert modify_plan(claim, uncertain) == plan


def test_an_infeasible_target_is_held_back_only_while_the_claim_still_asks_for_it() -> None:
    assert retried_slowly(pvc("bad", "gold", "Infeasible", "bad"))
    assert not retried_slowly(pvc("gold", "gold", "Infeasible", "bad"))
    assert not retried_slowly(pvc(None, "gold", "Infeasible", "bad"))
    assert not retried_slowly(pvc("bad", "gold"))


def test_in_progress_targets_the_spec_and_says_so() -> None:
    patch = modify_status_patch(pvc("gold", "silver"), "InProgress", NOW)
    assert patch["modifyVolumeStatus"] == {"status": "InProgress", "targetVolumeAttributesClassName": "gold"}
    (cond,) = patch["conditions"]
    assert cond == {
        "type": "ModifyingVolume",
        "status": "True",
        "lastProbeTime": NOW,
        "lastTransitionTime": NOW,
        "message": 'Modifying volume to "gold" is in progress.',
    }


def test_a_failure_keeps_the_target_and_shows_the_error() -> None:
    earlier = "2026-11-27T01:00:00Z"
    claim = pvc(
        "other",
        "silver",
        "InProgress",
        "gold",
        conditions=[{"type": "ModifyingVolume", "status": "True", "lastTransitionTime": earlier}],
    )
    final = modify_status_patch(
        claim, "Infeasible", NOW, ModifyFailure("InvalidArgument", "no such key", True)
    )
    assert final["modifyVolumeStatus"] == {"status": "Infeasible", "targetVolumeAttributesClassName": "gold"}
    modifying, error = final["conditions"]
    assert modifying["message"] == 'Modifying volume to "gold" failed. Waiting for retry.'
    assert modifying["lastTransitionTime"] == earlier, "same status, no reason: no transition"
    assert (error["type"], error["reason"], error["message"]) == (
        "ModifyVolumeError",
        "InvalidArgument",
        "no such key",
    )
    running = modify_status_patch(claim, "InProgress", NOW, ModifyFailure("DeadlineExceeded", "slow", False))
    assert running["conditions"][0]["message"] == 'Modifying volume to "gold" is still in progress.'


def test_pending_says_only_that() -> None:
    assert modify_status_patch(pvc("later", "gold"), "Pending", NOW) == {
        "modifyVolumeStatus": {"status": "Pending"}
    }


def test_completion_and_cancel_delete_only_the_conditions_there() -> None:
    claim = pvc(
        "gold", "silver", "InProgress", "gold", conditions=[{"type": "ModifyingVolume", "status": "True"}]
    )
    assert modify_completed_patch(claim, "gold") == {
        "modifyVolumeStatus": None,
        "currentVolumeAttributesClassName": "gold",
        "conditions": [{"type": "ModifyingVolume", "$patch": "delete"}],
    }
    assert cancel_patch(claim) == {"conditions": [{"type": "ModifyingVolume", "$patch": "delete"}]}
    assert cancel_patch(pvc("")) is None
