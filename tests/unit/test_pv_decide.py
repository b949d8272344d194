"""Pure phase decisions and bind writes of the pv-controller, and its local view."""

from __future__ import annotations

from typing import Any

import pytest

from controller_runtime import storage
from controller_runtime.kinds import (
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    as_obj,
    pv_view,
    pvc_view,
)
from controller_runtime.resources import Obj
from controller_runtime.store import Store
from services.pv_controller import names
from services.pv_controller.decide import (
    BindingModeUnset,
    BoundClaimAction,
    OperationBackoff,
    ReclaimAction,
    VolumeAction,
    claim_bound_to_volume,
    claim_lost,
    claim_with_provisioner,
    claim_with_status,
    decide_bound_claim,
    decide_reclaim,
    decide_volume,
    is_delay_binding,
    provisioning_error,
    unscheduled_pods,
    volume_bound_to_claim,
    volume_released,
    volume_unbound,
    volume_with_phase,
)
from services.pv_controller.view import LocalView

BBC = storage.ANN_BOUND_BY_CONTROLLER


def claim(volume_name: str = "", uid: str = "u1", **spec: Any) -> PersistentVolumeClaim:
    return pvc_view(
        {
            "metadata": {"name": "data", "namespace": "ns", "uid": uid, "resourceVersion": "7"},
            "spec": {"volumeName": volume_name, **spec},
            "status": {"phase": "Pending"},
        }
    )


def volume(
    ref_uid: str | None = None, annotations: dict[str, str] | None = None, **spec: Any
) -> PersistentVolume:
    obj: Obj = {
        "metadata": {"name": "pv1", "annotations": dict(annotations or {}), "resourceVersion": "3"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteOnce"], **spec},
        "status": {"phase": "Available"},
    }
    if ref_uid is not None:
        obj["spec"]["claimRef"] = {"namespace": "ns", "name": "data", "uid": ref_uid}
    return pv_view(obj)


@pytest.mark.parametrize(
    ("vol", "clm", "action"),
    [
        (volume(), None, VolumeAction.AVAILABLE),
        (volume(ref_uid=""), None, VolumeAction.PREBOUND),
        (volume(ref_uid="u1"), None, VolumeAction.RELEASE),
        (volume(ref_uid="u1"), claim(), VolumeAction.SYNC_CLAIM),
        (volume(ref_uid="u1", volumeMode="Block"), claim(), VolumeAction.MODE_MISMATCH),
        (volume(ref_uid="u1"), claim("pv1"), VolumeAction.BOUND),
        (volume(ref_uid="u1", annotations={BBC: "yes"}), claim("pv2"), VolumeAction.UNBIND),
        (volume(ref_uid="u1"), claim("pv2"), VolumeAction.UNBIND),
        (
            volume(
                ref_uid="u1",
                annotations={storage.ANN_PROVISIONED_BY: "x.io"},
                persistentVolumeReclaimPolicy="Delete",
            ),
            claim("pv2"),
            VolumeAction.RELEASE_PROVISIONED,
        ),
        (
            volume(
                ref_uid="u1",
                annotations={storage.ANN_PROVISIONED_BY: "x.io"},
                persistentVolumeReclaimPolicy="Retain",
            ),
            claim("pv2"),
            VolumeAction.UNBIND,
        ),
    ],
)
def test_decide_volume(
    vol: PersistentVolume, clm: PersistentVolumeClaim | None, action: VolumeAction
) -> None:
    assert decide_volume(vol, clm) is action


@pytest.mark.parametrize(
    ("policy", "annotations", "action"),
    [
        ("Retain", {}, ReclaimAction.NONE),
        ("Delete", {storage.ANN_PROVISIONED_BY: "loop.csi.kubeloop.dev"}, ReclaimAction.EXTERNAL_DELETE),
        ("Delete", {}, ReclaimAction.FAILED_DELETE),
        ("Delete", {storage.ANN_PROVISIONED_BY: "kubernetes.io/aws-ebs"}, ReclaimAction.FAILED_DELETE),
        ("Delete", {"csi": True}, ReclaimAction.EXTERNAL_DELETE),
        ("Delete", {storage.ANN_MIGRATED_TO: "ebs.csi.aws.com"}, ReclaimAction.NONE),
        ("Recycle", {}, ReclaimAction.RECYCLE_UNSUPPORTED),
        ("Shred", {}, ReclaimAction.UNKNOWN_POLICY),
    ],
)
def test_decide_reclaim(policy: str, annotations: dict[str, Any], action: ReclaimAction) -> None:
    # {"csi": True} stands for a static CSI volume (no provisioned-by): kcm leaves it to an
    # external deleter (findDeletablePlugin) and it stays Released, measured against kcm 1.36.
    spec: dict[str, Any] = {"persistentVolumeReclaimPolicy": policy}
    if annotations.pop("csi", False):
        spec["csi"] = {"driver": "loop.csi.kubeloop.dev", "volumeHandle": "h"}
    decision = decide_reclaim(volume(ref_uid="u1", annotations=annotations, **spec))
    assert decision.action is action
    if action is ReclaimAction.UNKNOWN_POLICY:
        assert decision.message == names.MSG_UNKNOWN_RECLAIM_POLICY


def test_failed_deletes_back_off_as_kcm_operations() -> None:
    backoff = OperationBackoff()
    assert backoff.ready("pv1", 100.0)
    backoff.failed("pv1", 100.0)
    assert not backoff.ready("pv1", 100.5) and backoff.ready("pv1", 100.6)
    backoff.failed("pv1", 100.6)  # the delay doubles: 1 s now
    assert not backoff.ready("pv1", 101.5) and backoff.ready("pv1", 101.7)
    for _ in range(20):
        backoff.failed("pv1", 200.0)
    assert not backoff.ready("pv1", 321.9) and backoff.ready("pv1", 322.1), "capped at 2 min 2 s"
    assert backoff.ready("pv2", 200.0)
    backoff.forget("pv1")
    assert backoff.ready("pv1", 200.0)


def test_volume_released() -> None:
    assert not volume_released(volume(), None)
    assert not volume_released(volume(ref_uid=""), None), "a user's pre-binding is never released"
    assert volume_released(volume(ref_uid="u1"), None)
    assert volume_released(volume(ref_uid="u1"), claim(uid="u2"))
    assert not volume_released(volume(ref_uid="u1"), claim())
    assert not volume_released(volume(ref_uid="u1"), claim("pv1"))
    assert volume_released(volume(ref_uid="u1"), claim("pv2"))


@pytest.mark.parametrize(
    ("clm", "vol", "action"),
    [
        (claim(""), volume(), BoundClaimAction.LOST_REFERENCE),
        (claim("pv1"), None, BoundClaimAction.LOST_VOLUME),
        (claim("pv1"), volume(), BoundClaimAction.BIND),
        (claim("pv1"), volume(ref_uid="u1"), BoundClaimAction.BIND),
        (claim("pv1"), volume(ref_uid="u2"), BoundClaimAction.MISBOUND),
    ],
)
def test_decide_bound_claim(
    clm: PersistentVolumeClaim, vol: PersistentVolume | None, action: BoundClaimAction
) -> None:
    assert decide_bound_claim(clm, vol) is action


def test_bind_writes_set_bound_by_controller_only_for_our_links() -> None:
    # The controller chose the volume: both objects carry bound-by-controller.
    new_pv = volume_bound_to_claim(volume(), claim())
    assert new_pv is not None
    assert new_pv["spec"]["claimRef"]["uid"] == "u1"
    assert new_pv["spec"]["claimRef"]["resourceVersion"] == "7"
    assert new_pv["metadata"]["annotations"][BBC] == "yes"
    new_pvc = claim_bound_to_volume(claim(), pv_view(new_pv))
    assert new_pvc is not None and new_pvc["spec"]["volumeName"] == "pv1"
    assert new_pvc["metadata"]["annotations"] == {storage.ANN_BIND_COMPLETED: "yes", BBC: "yes"}
    # The user pre-bound the volume by name: the PV gets the UID but no annotation.
    user_pv = volume_bound_to_claim(volume(ref_uid=""), claim())
    assert user_pv is not None and BBC not in user_pv["metadata"]["annotations"]
    # The user named the volume in the claim: only bind-completed.
    user_pvc = claim_bound_to_volume(claim("pv1"), pv_view(new_pv))
    assert user_pvc is not None and user_pvc["metadata"]["annotations"] == {storage.ANN_BIND_COMPLETED: "yes"}


def test_bind_writes_are_skipped_when_done() -> None:
    done_pv = volume(ref_uid="u1", annotations={BBC: "yes"})
    assert volume_bound_to_claim(done_pv, claim()) is None
    assert volume_with_phase({**done_pv, "status": {"phase": "Bound"}}, "Bound") is None
    done_pvc = claim("pv1")
    done_pvc["metadata"]["annotations"] = {storage.ANN_BIND_COMPLETED: "yes"}
    assert claim_bound_to_volume(done_pvc, done_pv) is None


def test_claim_status_copies_capacity_only_on_the_transition() -> None:
    vol = volume(ref_uid="u1")
    bound = claim_with_status(claim("pv1"), "Bound", vol)
    assert bound is not None
    assert bound["status"] == {
        "phase": "Bound",
        "accessModes": ["ReadWriteOnce"],
        "capacity": {"storage": "1Gi"},
    }
    resized = {**bound, "status": {**bound["status"], "capacity": {"storage": "2Gi"}}}
    assert claim_with_status(pvc_view(resized), "Bound", vol) is None, (
        "a later capacity difference is a resize"
    )
    lost = claim_with_status(pvc_view(bound), "Lost", None)
    assert lost is not None and lost["status"] == {"phase": "Lost"}


def test_claim_takes_the_volumes_attributes_class_when_it_binds_and_only_then() -> None:
    # kcm's updateClaimStatus: current = the volume's class on Pending -> Bound; later the
    # external-resizer alone changes it; a claim losing its volume loses it with the rest.
    gold = volume(ref_uid="u1", volumeAttributesClassName="gold")
    bound = claim_with_status(claim("pv1", volumeAttributesClassName="gold"), "Bound", gold)
    assert bound is not None and bound["status"]["currentVolumeAttributesClassName"] == "gold"
    modified = {**bound, "status": {**bound["status"], "currentVolumeAttributesClassName": "silver"}}
    assert claim_with_status(pvc_view(modified), "Bound", gold) is None, (
        "the resizer's value is not overwritten"
    )
    lost = claim_with_status(pvc_view(modified), "Lost", None)
    assert lost is not None and "currentVolumeAttributesClassName" not in lost["status"]
    stale = pvc_view(
        {**claim("pv1"), "status": {"phase": "Pending", "currentVolumeAttributesClassName": "gold"}}
    )
    plain = claim_with_status(stale, "Bound", volume(ref_uid="u1"))
    assert plain is not None and "currentVolumeAttributesClassName" not in plain["status"]


def test_claim_capacity_from_the_pre_resize_annotation() -> None:
    # updateClaimStatus: a volume expanded without its filesystem yet reports the old size, even
    # when the claim already shows the volume's size; other capacity keys stay.
    ann = {names.ANN_PRE_RESIZE_CAPACITY: "512Mi"}
    pending = pvc_view(
        {**claim("pv1"), "status": {"phase": "Pending", "capacity": {"storage": "1Gi", "x": "1"}}}
    )
    bound = claim_with_status(pending, "Bound", volume(ref_uid="u1", annotations=ann))
    assert bound is not None and bound["status"]["capacity"] == {"storage": "512Mi", "x": "1"}
    bad = claim_with_status(
        claim("pv1"), "Bound", volume(ref_uid="u1", annotations={names.ANN_PRE_RESIZE_CAPACITY: "lots"})
    )
    assert bad is not None and bad["status"]["capacity"] == {"storage": "1Gi"}
    assert claim_with_status(pvc_view(bound), "Bound", volume(ref_uid="u1", annotations=ann)) is None, (
        "only on the transition"
    )


def test_volume_phase_leaves_the_transition_time_to_the_apiserver() -> None:
    # kcm's updateVolumePhase sets phase and message only; the apiserver's status strategy stamps
    # lastPhaseTransitionTime when the phase changes and the client sent the old time unchanged.
    old = volume()
    old["status"]["lastPhaseTransitionTime"] = "2026-01-02T03:04:05Z"
    new = volume_with_phase(old, "Failed", "boom")
    assert new is not None
    assert new["status"] == {
        "phase": "Failed",
        "message": "boom",
        "lastPhaseTransitionTime": "2026-01-02T03:04:05Z",
    }
    fresh = volume_with_phase(volume(), "Bound")
    assert fresh is not None and "lastPhaseTransitionTime" not in fresh["status"]


def test_a_claim_already_lost_is_left_alone() -> None:
    # updateClaimStatusWithEvent returns at once when the phase is already set: no write, no event,
    # even when the status still carries access modes and capacity (measured against kcm 1.36).
    bound = pvc_view(
        {
            **claim("pv1"),
            "status": {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}},
        }
    )
    lost = claim_lost(bound)
    assert lost is not None and lost["status"] == {"phase": "Lost"}
    assert claim_lost(pvc_view(lost)) is None
    assert claim_lost({**bound, "status": {**bound["status"], "phase": "Lost"}}) is None


def test_only_live_unscheduled_pods_wait_for_scheduling() -> None:
    def pod(name: str, node: str = "", phase: str = "Pending", **md: Any) -> Obj:
        return {"metadata": {"name": name, **md}, "spec": {"nodeName": node}, "status": {"phase": phase}}

    pods = [
        pod("waiting-b"),
        pod("waiting-a"),
        pod("scheduled", node="n1"),
        pod("failed", phase="Failed"),
        pod("succeeded", phase="Succeeded"),
        pod("deleted", deletionTimestamp="2026-01-02T03:04:05Z"),
    ]
    assert unscheduled_pods(pods) == ["waiting-a", "waiting-b"]
    assert unscheduled_pods([pod("failed", phase="Failed")]) == []


@pytest.mark.parametrize(
    ("class_name", "cls", "delay"),
    [
        ("", None, False),
        ("gone", None, False),
        ("fast", {"volumeBindingMode": "Immediate"}, False),
        ("slow", {"volumeBindingMode": "WaitForFirstConsumer"}, True),
    ],
)
def test_delay_binding(class_name: str, cls: StorageClass | None, delay: bool) -> None:
    assert is_delay_binding(class_name, cls) is delay


def test_a_class_without_binding_mode_is_an_error() -> None:
    with pytest.raises(BindingModeUnset) as raised:
        is_delay_binding("odd", {"provisioner": "x.io"})
    assert str(raised.value) == 'VolumeBindingMode not set for StorageClass "odd"'


def test_unbind_drops_our_binding_but_keeps_a_users_claim_name() -> None:
    ours = volume_unbound(volume(ref_uid="u1", annotations={BBC: "yes"}))
    assert "claimRef" not in ours["spec"] and not ours["metadata"]["annotations"]
    users = volume_unbound(volume(ref_uid="u1"))
    assert users["spec"]["claimRef"] == {"namespace": "ns", "name": "data"}


def test_provisioner_handoff_writes_both_keys_once() -> None:
    new = claim_with_provisioner(claim(), "loop.csi.kubeloop.dev")
    assert new is not None
    ann = new["metadata"]["annotations"]
    assert (
        ann[storage.ANN_STORAGE_PROVISIONER]
        == ann[storage.ANN_BETA_STORAGE_PROVISIONER]
        == "loop.csi.kubeloop.dev"
    )
    assert claim_with_provisioner(pvc_view(new), "loop.csi.kubeloop.dev") is None


def test_provisioning_errors_use_kcm_wording() -> None:
    assert provisioning_error("gold", None) == 'storageclass.storage.k8s.io "gold" not found'
    assert provisioning_error("x", {"provisioner": storage.NO_PROVISIONER}) == (
        "no volume plugin matched name: kubernetes.io/no-provisioner"
    )
    assert provisioning_error("x", {"provisioner": "loop.csi.kubeloop.dev"}) is None


def held(view: LocalView, name: str) -> Obj | None:
    """The volume the view serves, as the plain object it is."""
    volume = view.volume(name)
    return None if volume is None else as_obj(volume)


def test_view_ignores_older_objects_and_deleted_ones() -> None:
    view = LocalView()
    v5 = {**volume(), "metadata": {"name": "pv1", "resourceVersion": "5"}}
    v4 = {**volume(ref_uid="u1"), "metadata": {"name": "pv1", "resourceVersion": "4"}}
    assert view.volume_written(v5)
    assert not view.volume_written(v4), "an older copy never replaces a newer one"
    assert held(view, "pv1") is v5
    view.delete_volume({**v5, "metadata": {"name": "pv1", "resourceVersion": "6"}})
    assert not view.volume_written(v5), "a late answer cannot resurrect a deleted volume"
    assert view.volume("pv1") is None
    recreated = {**volume(), "metadata": {"name": "pv1", "resourceVersion": "9"}}
    assert view.volume_written(recreated)


def test_view_reads_the_informer_cache_through_its_own_writes() -> None:
    """The informer's store is only read: the view serves our newer write over it until the store
    holds that version, and indexes whichever is freshest."""
    store = Store()
    view = LocalView(volumes=store)
    cached = {**volume(), "metadata": {"name": "pv1", "resourceVersion": "5"}}
    store.upsert(cached)
    view.volume_observed("pv1")
    bound = {**volume(ref_uid="u1"), "metadata": {"name": "pv1", "resourceVersion": "7"}}
    assert view.volume_written(bound)
    assert held(view, "pv1") is bound and store.get("pv1") is cached
    assert view.index.bound_to("ns/data") == ["pv1"], "the index follows our write"
    caught_up = {**bound, "metadata": {"name": "pv1", "resourceVersion": "7"}}
    store.upsert(caught_up)
    view.volume_observed("pv1")
    assert held(view, "pv1") is caught_up


def test_view_reservations_are_exclusive() -> None:
    view = LocalView()
    assert view.reserve("pv1", "ns/a")
    assert not view.reserve("pv1", "ns/b")
    assert view.reserved_by_other("pv1", "ns/b") and not view.reserved_by_other("pv1", "ns/a")
    view.release("pv1", "ns/b")  # not the holder: no effect
    assert view.reserved_by_other("pv1", "ns/b")
    view.release("pv1", "ns/a")
    assert view.reserve("pv1", "ns/b")


def test_view_wakes_the_oldest_waiting_claim_that_fits() -> None:
    view = LocalView()
    for name in ("a", "b", "c"):
        view.claim_written(
            {"metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"}, "spec": {}}
        )
        view.waiting[f"ns/{name}"] = None
    assert view.wake_one(lambda c: c["metadata"]["name"] != "a") == "ns/b"
    assert list(view.waiting) == ["ns/a", "ns/c"]
    assert view.wake_one(lambda c: False) is None
