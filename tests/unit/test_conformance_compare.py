"""The conformance comparator (tests/conformance/compare.py) without an apiserver: identical
outcomes recorded under different names, UIDs and handles compare identical; a deliberately
introduced divergence is reported with a readable diff; an expected difference must match exactly."""

from __future__ import annotations

import copy

from controller_runtime.volumes import va_name
from csi_driver import DRIVER_NAME
from tests.conformance.compare import RawOutcome, compare, normalise
from tests.conformance.model import ExpectedDifference, Obj


def outcome(ns: str, prefix: str, claim_uid: str, handle: str, *, phase: str = "Bound") -> RawOutcome:
    """A provisioned, attached claim as one mode's run records it."""
    pv_name = f"pvc-{claim_uid}"
    claim: Obj = {
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": "claim1",
            "namespace": ns,
            "uid": claim_uid,
            "resourceVersion": "812",
            "creationTimestamp": "2026-11-23T17:00:00Z",
            "annotations": {"pv.kubernetes.io/bind-completed": "yes"},
        },
        "spec": {"volumeName": pv_name, "storageClassName": f"{prefix}fast"},
        "status": {
            "phase": phase,
            "conditions": [
                {"type": "Resizing", "status": "True", "lastTransitionTime": "2026-11-23T17:00:01Z"}
            ],
        },
    }
    pv: Obj = {
        "kind": "PersistentVolume",
        "metadata": {"name": pv_name, "uid": f"{claim_uid[:-4]}beef"},
        "spec": {
            "claimRef": {"namespace": ns, "name": "claim1", "uid": claim_uid},
            "csi": {"driver": DRIVER_NAME, "volumeHandle": handle},
        },
        "status": {"phase": "Bound", "lastPhaseTransitionTime": "2026-11-23T17:00:01Z"},
    }
    va: Obj = {
        "kind": "VolumeAttachment",
        "metadata": {"name": va_name(handle, DRIVER_NAME, "node-a"), "uid": f"{claim_uid[:-4]}cafe"},
        "spec": {"attacher": DRIVER_NAME, "nodeName": "node-a", "source": {"persistentVolumeName": pv_name}},
        "status": {"attached": True},
    }

    def ev(reason: str, message: str, count: int) -> Obj:
        return {
            "kind": "Event",
            "involvedObject": {"kind": "PersistentVolumeClaim", "namespace": ns, "name": "claim1"},
            "type": "Normal",
            "reason": reason,
            "message": message,
            "count": count,
            "source": {"component": "persistentvolume-controller"},
        }

    msg = f"Successfully provisioned volume {pv_name}"
    return RawOutcome(
        "s",
        ns,
        prefix,
        timeline=[],
        snapshots={"final": [pv, claim, va]},
        # The same event twice (aggregated, count 2) must read as once.
        events=[
            ev("Provisioning", f'External provisioner is provisioning volume for claim "{ns}/claim1"', 1),
            ev("ProvisioningSucceeded", msg, 1),
            ev("ProvisioningSucceeded", msg, 2),
        ],
        seen=[claim, pv, va],
    )


GO = outcome("cf-001", "cf001-", "11111111-2222-3333-4444-555555555555", "vol-" + "a" * 32)
KUBELOOP = outcome("cf-001", "cf001-", "99999999-8888-7777-6666-555555555555", "vol-" + "b" * 32)


def test_identical_outcomes_under_other_names_compare_identical() -> None:
    verdict = compare("s", normalise(GO), normalise(KUBELOOP))
    assert verdict.status == "identical", verdict.diff
    doc = normalise(KUBELOOP)
    pv = doc["snapshots"]["final"]["PersistentVolume/pvc-uid(PersistentVolumeClaim/claim1)"]
    assert pv["spec.csi.volumeHandle"] == "vol(pvc-uid(PersistentVolumeClaim/claim1))"
    assert "VolumeAttachment/csi(pvc-uid(PersistentVolumeClaim/claim1)@node-a)" in doc["snapshots"]["final"]
    assert doc["snapshots"]["final"]["PersistentVolumeClaim/claim1"]["spec.storageClassName"] == "fast"
    assert doc["events"]["PersistentVolumeClaim/claim1"] == {
        "persistentvolume-controller": [
            'Normal Provisioning: External provisioner is provisioning volume for claim "NS/claim1"',
            "Normal ProvisioningSucceeded: Successfully provisioned volume "
            "pvc-uid(PersistentVolumeClaim/claim1)",
        ]
    }


def test_introduced_divergence_is_reported_with_a_diff() -> None:
    diverged = copy.deepcopy(KUBELOOP)
    diverged.snapshots["final"][1]["status"]["phase"] = "Lost"
    diverged.events.append(
        {**diverged.events[0], "type": "Warning", "reason": "ClaimLost", "message": "gone"}
    )
    verdict = compare("s", normalise(GO), normalise(diverged))
    assert verdict.status == "differ"
    assert "-      status.phase: Bound" in verdict.diff
    assert "+      status.phase: Lost" in verdict.diff
    assert "+    - 'Warning ClaimLost: gone'" in verdict.diff
    assert verdict.diff.startswith("--- go\n+++ kubeloop")


def test_event_order_matters_but_repeats_do_not() -> None:
    swapped = copy.deepcopy(KUBELOOP)
    swapped.events = [swapped.events[1], swapped.events[0]]
    assert compare("s", normalise(GO), normalise(swapped)).status == "differ"


def test_independent_events_of_one_reason_compare_in_any_order() -> None:
    """Two volumes of one pod attached at once: their SuccessfulAttachVolume events come in either
    order, in both modes. Events of different reasons keep their order (test above)."""

    def attached(volumes: tuple[str, ...]) -> RawOutcome:
        raw = copy.deepcopy(GO)
        base = {**raw.events[0], "reason": "SuccessfulAttachVolume"}
        raw.events = [{**base, "message": f'AttachVolume.Attach succeeded for volume "{v}"'} for v in volumes]
        return raw

    one_way, other_way = attached(("pv-c1", "pv-c2")), attached(("pv-c2", "pv-c1"))
    assert compare("s", normalise(one_way), normalise(other_way)).status == "identical"
    assert compare("s", normalise(one_way), normalise(attached(("pv-c1",)))).status == "differ"


def test_expected_difference_must_match_exactly() -> None:
    diverged = copy.deepcopy(KUBELOOP)
    diverged.snapshots["final"][1]["status"]["phase"] = "Lost"
    lines = ("-status.phase: Bound", "+status.phase: Lost")
    ok = compare("s", normalise(GO), normalise(diverged), ExpectedDifference("kept on purpose", lines))
    assert ok.status == "expected-difference"
    assert ok.expected_reason == "kept on purpose"
    diverged.snapshots["final"][0]["status"]["phase"] = "Released"
    other = compare("s", normalise(GO), normalise(diverged), ExpectedDifference("kept on purpose", lines))
    assert other.status == "differ"


def test_instance_identity_and_conflict_retries_are_not_compared() -> None:
    go = copy.deepcopy(GO)
    kubeloop = copy.deepcopy(KUBELOOP)
    go.events[0]["source"] = {"component": "loop.csi.kubeloop.dev_vm_0b5e1c1e-4d8e-4e38-9a55-0e3a3b1d2c4f"}
    kubeloop.events[0]["source"] = {"component": "loop.csi.kubeloop.dev_vm"}
    conflict = "Operation cannot be fulfilled on persistentvolumeclaims: the object has been modified"
    go.events.append({**go.events[0], "type": "Warning", "reason": "VolumeResizeFailed", "message": conflict})
    assert compare("s", normalise(go), normalise(kubeloop)).status == "identical"
