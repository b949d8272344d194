"""pv-controller against the real apiserver: one table case per upstream binder behaviour.

Each case creates its initial objects (intermediate states are written directly, as a crash would
leave them), starts one controller in-process, and waits for the expected final objects and events.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable

import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import PersistentVolume, PersistentVolumeClaim
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj
from localstack.controlplane import ControlPlane
from services.pv_controller import names
from services.pv_controller.controller import PVController
from tests.support.waits import consistently_async, eventually_async, no_problems

from .pv_controller_harness import (
    ANY,
    BIND_COMPLETED,
    BOUND_BY_CONTROLLER,
    NO_UID,
    OTHER_UID,
    PROVISIONER,
    PV,
    PVC,
    SC,
    Case,
    WantEvent,
    WantPV,
    WantPVC,
    harness,
)

pytestmark = pytest.mark.integration

RWO = ("ReadWriteOnce",)
CONTROLLER_BOUND = {BIND_COMPLETED: "yes", BOUND_BY_CONTROLLER: "yes"}
USER_BOUND = {BIND_COMPLETED: "yes", BOUND_BY_CONTROLLER: None}
BOUND_CLAIM = {BIND_COMPLETED: "yes"}
NOT_ATTEMPTED = {BIND_COMPLETED: None}

UNBOUND_CLAIMS = [
    Case(
        "bind",
        pvs=(PV("pv1"),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),),
        want_pvcs=(WantPVC("data", "Bound", "pv1", CONTROLLER_BOUND),),
    ),
    Case(
        "smallest-fit",
        pvs=(PV("big", "10Gi"), PV("fit", "2Gi"), PV("small", "500Mi")),
        pvcs=(PVC("data", "1Gi"),),
        want_pvs=(
            WantPV("fit", "Bound", "data", "data"),
            WantPV("big", "Available"),
            WantPV("small", "Available"),
        ),
        want_pvcs=(WantPVC("data", "Bound", "fit"),),
    ),
    Case(
        "fewest-access-modes",
        pvs=(PV("rwo-rwx", "1Gi", ("ReadWriteOnce", "ReadWriteMany")), PV("rwo", "5Gi")),
        pvcs=(PVC("data", "1Gi"),),
        want_pvs=(WantPV("rwo", "Bound", "data"), WantPV("rwo-rwx", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "rwo"),),
    ),
    Case(
        "pre-bound-by-name-wins",
        pvs=(PV("exact", "1Gi"), PV("reserved", "5Gi", claim="data", claim_uid=NO_UID)),
        pvcs=(PVC("data", "1Gi"),),
        want_pvs=(
            WantPV("reserved", "Bound", "data", "data", {BOUND_BY_CONTROLLER: None}),
            WantPV("exact", "Available"),
        ),
        want_pvcs=(WantPVC("data", "Bound", "reserved", CONTROLLER_BOUND),),
    ),
    Case(
        "pre-bound-by-uid",
        pvs=(PV("exact", "1Gi"), PV("reserved", "5Gi", claim="data")),
        pvcs=(PVC("data", "1Gi"),),
        want_pvs=(WantPV("reserved", "Bound", "data", "data", {BOUND_BY_CONTROLLER: None}),),
        want_pvcs=(WantPVC("data", "Bound", "reserved", CONTROLLER_BOUND),),
    ),
    Case(
        "pre-bound-to-another-claim",
        pvs=(PV("reserved", claim="someone-else", claim_uid=NO_UID),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("reserved", "Available", "someone-else", NO_UID),),
        want_pvcs=(WantPVC("data", "Pending", None, NOT_ATTEMPTED),),
        want_events=(WantEvent("data", names.FAILED_BINDING, names.MSG_NO_CLASS),),
    ),
    Case(
        "crash-after-write-1-pv-claimref",
        pvs=(PV("pv1", claim="data", phase="Available", annotations={BOUND_BY_CONTROLLER: "yes"}),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),),
        want_pvcs=(WantPVC("data", "Bound", "pv1", CONTROLLER_BOUND),),
    ),
    Case(
        "crash-after-write-2-pv-bound",
        pvs=(PV("pv1", claim="data", phase="Bound", annotations={BOUND_BY_CONTROLLER: "yes"}),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),),
        want_pvcs=(WantPVC("data", "Bound", "pv1", CONTROLLER_BOUND),),
    ),
    Case(
        "crash-after-write-3-pvc-volumename",
        pvs=(PV("pv1", claim="data", phase="Bound", annotations={BOUND_BY_CONTROLLER: "yes"}),),
        pvcs=(PVC("data", volume="pv1", annotations=CONTROLLER_BOUND),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1", CONTROLLER_BOUND),),
    ),
    Case(
        "crash-after-write-4-nothing-left",
        pvs=(PV("pv1", claim="data", phase="Bound", annotations={BOUND_BY_CONTROLLER: "yes"}),),
        pvcs=(PVC("data", volume="pv1", phase="Bound", annotations=CONTROLLER_BOUND),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1", CONTROLLER_BOUND),),
    ),
    Case(
        "selector-match",
        pvs=(PV("plain", "1Gi"), PV("gold", "2Gi", labels={"tier": "gold"})),
        pvcs=(PVC("data", selector={"matchLabels": {"tier": "gold"}}),),
        want_pvs=(WantPV("gold", "Bound", "data"), WantPV("plain", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "gold"),),
    ),
    Case(
        "selector-mismatch",
        pvs=(PV("plain", labels={"tier": "bronze"}),),
        pvcs=(
            PVC(
                "data",
                selector={"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]},
            ),
        ),
        want_pvs=(WantPV("plain", "Available"),),
        want_pvcs=(WantPVC("data", "Pending"),),
        want_events=(WantEvent("data", names.FAILED_BINDING, names.MSG_NO_CLASS),),
    ),
    Case(
        "wait-for-first-consumer",
        classes=(SC("local", storage.NO_PROVISIONER, wait_for_consumer=True),),
        pvs=(PV("pv1", cls="local"),),
        pvcs=(PVC("data", cls="local"),),
        want_pvs=(WantPV("pv1", "Available"),),
        want_pvcs=(WantPVC("data", "Pending"),),
        want_events=(WantEvent("data", names.WAIT_FOR_FIRST_CONSUMER, names.MSG_WAIT_FIRST_CONSUMER),),
    ),
    Case(
        "skip-non-available-volumes",
        pvs=(
            PV("released", "1Gi", claim="gone", claim_uid=OTHER_UID, phase="Released"),
            PV("available", "5Gi"),
        ),
        pvcs=(PVC("data", "1Gi"),),
        want_pvs=(WantPV("available", "Bound", "data"), WantPV("released", "Released", "gone")),
        want_pvcs=(WantPVC("data", "Bound", "available"),),
    ),
]

PREBOUND_CLAIMS = [
    Case(
        "named-volume-missing",
        pvcs=(PVC("data", volume="nothere"),),
        pvs=(PV("other"),),
        want_pvs=(WantPV("other", "Available"),),
        want_pvcs=(WantPVC("data", "Pending", "nothere", NOT_ATTEMPTED),),
    ),
    Case(
        "named-volume-unbound",
        pvs=(PV("small", "1Gi"), PV("named", "5Gi")),
        pvcs=(PVC("data", volume="named"),),
        want_pvs=(WantPV("named", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),),
        want_pvcs=(WantPVC("data", "Bound", "named", USER_BOUND),),
    ),
    Case(
        "named-volume-bound-elsewhere",
        pvs=(PV("named", claim="owner", phase="Bound"),),
        pvcs=(
            PVC("owner", volume="named", phase="Bound", annotations=BOUND_CLAIM),
            PVC("data", volume="named"),
        ),
        want_pvs=(WantPV("named", "Bound", "owner", "owner"),),
        want_pvcs=(WantPVC("data", "Pending", "named"), WantPVC("owner", "Bound", "named")),
        want_events=(WantEvent("data", names.FAILED_BINDING, "already bound to a different claim."),),
    ),
    Case(
        "named-volume-too-small",
        pvs=(PV("named", "1Gi"),),
        pvcs=(PVC("data", "2Gi", volume="named"),),
        want_pvs=(WantPV("named", "Available"),),
        want_pvcs=(WantPVC("data", "Pending", "named"),),
        want_events=(WantEvent("data", names.VOLUME_MISMATCH, "requested PV is too small"),),
    ),
    Case(
        "named-volume-class-mismatch",
        classes=(SC("gold"),),
        pvs=(PV("named", cls="gold"),),
        pvcs=(PVC("data", cls="", volume="named"),),
        want_pvs=(WantPV("named", "Available"),),
        want_pvcs=(WantPVC("data", "Pending", "named"),),
        want_events=(WantEvent("data", names.VOLUME_MISMATCH, "storageClassName does not match"),),
    ),
    Case(
        "named-volume-mode-mismatch",
        pvs=(PV("named", volume_mode="Block"),),
        pvcs=(PVC("data", volume="named"),),
        want_pvs=(WantPV("named", "Available"),),
        want_pvcs=(WantPVC("data", "Pending", "named"),),
        want_events=(WantEvent("data", names.VOLUME_MISMATCH, "incompatible volumeMode"),),
    ),
]

BOUND_CLAIMS = [
    Case(
        "lost-volume",
        pvcs=(PVC("data", volume="gone", phase="Bound", annotations=BOUND_CLAIM),),
        want_pvcs=(WantPVC("data", "Lost", "gone"),),
        want_events=(WantEvent("data", names.CLAIM_LOST_REASON, names.MSG_CLAIM_LOST_VOLUME),),
    ),
    Case(
        "lost-reference",
        pvcs=(PVC("data", phase="Bound", annotations=BOUND_CLAIM),),
        want_pvcs=(WantPVC("data", "Lost"),),
        want_events=(WantEvent("data", names.CLAIM_LOST_REASON, names.MSG_CLAIM_LOST_REFERENCE),),
    ),
    Case(
        "misbound",
        pvs=(PV("pv1", claim="owner", phase="Bound"),),
        pvcs=(
            PVC("owner", volume="pv1", phase="Bound", annotations=BOUND_CLAIM),
            PVC("data", volume="pv1", phase="Bound", annotations=BOUND_CLAIM),
        ),
        want_pvs=(WantPV("pv1", "Bound", "owner", "owner"),),
        want_pvcs=(WantPVC("data", "Lost", "pv1"), WantPVC("owner", "Bound", "pv1")),
        want_events=(WantEvent("data", names.CLAIM_MISBOUND, names.MSG_CLAIM_MISBOUND),),
    ),
    Case(
        "re-bind-unbound-volume",
        pvs=(PV("pv1", phase="Available"),),
        pvcs=(PVC("data", volume="pv1", phase="Bound", annotations=BOUND_CLAIM),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),),
        want_pvcs=(WantPVC("data", "Bound", "pv1"),),
    ),
]

VOLUMES = [
    Case("unused-becomes-available", pvs=(PV("pv1"),), want_pvs=(WantPV("pv1", "Available"),)),
    Case(
        "released-when-claim-missing",
        pvs=(PV("pv1", claim="gone", claim_uid=OTHER_UID, phase="Bound"),),
        want_pvs=(WantPV("pv1", "Released", "gone"),),
    ),
    Case(
        "released-when-claim-has-new-uid",
        pvs=(PV("pv1", claim="data", claim_uid=OTHER_UID, phase="Bound"),),
        pvcs=(PVC("data", "5Gi"),),
        want_pvs=(WantPV("pv1", "Released", "data"),),
        want_pvcs=(WantPVC("data", "Pending"),),
    ),
    Case(
        "rollback-controller-binding",
        pvs=(
            PV("loser", claim="data", phase="Bound", annotations={BOUND_BY_CONTROLLER: "yes"}),
            PV("winner", claim="data", phase="Bound"),
        ),
        pvcs=(PVC("data", volume="winner", phase="Bound", annotations=CONTROLLER_BOUND),),
        want_pvs=(
            WantPV("loser", "Available", None, ANY, {BOUND_BY_CONTROLLER: None}),
            WantPV("winner", "Bound", "data", "data"),
        ),
        want_pvcs=(WantPVC("data", "Bound", "winner"),),
    ),
    Case(
        "user-binding-keeps-claim-name",
        pvs=(PV("users", claim="data", phase="Bound"), PV("winner", claim="data", phase="Bound")),
        pvcs=(PVC("data", volume="winner", phase="Bound", annotations=CONTROLLER_BOUND),),
        want_pvs=(WantPV("users", "Available", "data", NO_UID), WantPV("winner", "Bound", "data")),
        want_pvcs=(WantPVC("data", "Bound", "winner"),),
    ),
    Case(
        "provisioned-delete-volume-released-when-claim-bound-elsewhere",
        pvs=(
            PV(
                "provisioned",
                claim="data",
                phase="Bound",
                policy="Delete",
                annotations={storage.ANN_PROVISIONED_BY: PROVISIONER},
            ),
            PV("winner", claim="data", phase="Bound"),
        ),
        pvcs=(PVC("data", volume="winner", phase="Bound", annotations=CONTROLLER_BOUND),),
        want_pvs=(WantPV("provisioned", "Released", "data"), WantPV("winner", "Bound", "data")),
    ),
    Case(
        "volume-mode-mismatch-with-claimref",
        pvs=(PV("block", claim="data", volume_mode="Block", phase="Available"),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("block", "Available", "data"),),
        want_pvcs=(WantPVC("data", "Pending"),),
        want_events=(
            WantEvent("block", names.VOLUME_MISMATCH, "due to incompatible volumeMode"),
            WantEvent("data", names.VOLUME_MISMATCH, "due to incompatible volumeMode"),
        ),
    ),
]

RECLAIM = [
    Case(
        "retain-stays-released",
        pvs=(PV("pv1", claim="gone", claim_uid=OTHER_UID, phase="Bound", policy="Retain"),),
        want_pvs=(WantPV("pv1", "Released", "gone"),),
    ),
    Case(
        "delete-by-external-provisioner-left-to-it",
        pvs=(
            PV(
                "pv1",
                claim="gone",
                claim_uid=OTHER_UID,
                phase="Bound",
                policy="Delete",
                annotations={storage.ANN_PROVISIONED_BY: PROVISIONER},
            ),
        ),
        want_pvs=(WantPV("pv1", "Released", "gone"),),
    ),
    Case(
        "delete-without-deleter-fails",
        pvs=(PV("pv1", claim="gone", claim_uid=OTHER_UID, phase="Bound", policy="Delete"),),
        want_pvs=(WantPV("pv1", "Failed", "gone"),),
        want_events=(WantEvent("pv1", storage.VOLUME_FAILED_DELETE, "no deletable volume plugin matched"),),
    ),
    Case(
        # kcm (HonorPVReclaimPolicy) leaves a CSI volume without provisioned-by to an external
        # deleter: Released, no VolumeFailedDelete (as kcm 1.36 did with the same volume).
        "static-csi-delete-left-to-an-external-deleter",
        pvs=(PV("pv1", claim="gone", claim_uid=OTHER_UID, phase="Bound", policy="Delete", csi=True),),
        want_pvs=(WantPV("pv1", "Released", "gone"),),
    ),
    Case(
        "recycle-not-supported",
        pvs=(PV("pv1", claim="gone", claim_uid=OTHER_UID, phase="Bound", policy="Recycle"),),
        want_pvs=(WantPV("pv1", "Failed", "gone"),),
        want_events=(WantEvent("pv1", names.VOLUME_FAILED_RECYCLE, "not supported"),),
    ),
]

CLASSES = [
    Case(
        "nil-class-matches-empty-class",
        pvs=(PV("pv1", cls=""),),
        pvcs=(PVC("data", cls=None),),
        want_pvs=(WantPV("pv1", "Bound", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1"),),
    ),
    Case(
        "empty-class-matches-unset-class",
        pvs=(PV("pv1", cls=None),),
        pvcs=(PVC("data", cls=""),),
        want_pvs=(WantPV("pv1", "Bound", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1"),),
    ),
    Case(
        "named-class-only-matches-its-volumes",
        classes=(SC("gold"),),
        pvs=(PV("classless", "1Gi", cls=""), PV("gold", "5Gi", cls="gold")),
        pvcs=(PVC("data", cls="gold"),),
        want_pvs=(WantPV("gold", "Bound", "data"), WantPV("classless", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "gold"),),
    ),
    Case(
        "external-provisioning-handoff",
        classes=(SC("gold"),),
        pvs=(PV("classless", cls=""),),
        pvcs=(PVC("data", cls="gold"),),
        want_pvs=(WantPV("classless", "Available"),),
        want_pvcs=(
            WantPVC(
                "data",
                "Pending",
                annotations={
                    storage.ANN_STORAGE_PROVISIONER: PROVISIONER,
                    storage.ANN_BETA_STORAGE_PROVISIONER: PROVISIONER,
                },
            ),
        ),
        want_events=(
            WantEvent("data", names.EXTERNAL_PROVISIONING, names.msg_external_provisioning(PROVISIONER)),
        ),
    ),
    Case(
        "class-does-not-exist",
        pvcs=(PVC("data", cls="missing"),),
        want_pvcs=(WantPVC("data", "Pending", annotations={storage.ANN_STORAGE_PROVISIONER: None}),),
        want_events=(WantEvent("data", storage.PROVISIONING_FAILED, "not found"),),
    ),
    Case(
        "no-provisioner-class",
        classes=(SC("static", storage.NO_PROVISIONER),),
        pvcs=(PVC("data", cls="static"),),
        want_pvcs=(WantPVC("data", "Pending"),),
        want_events=(
            WantEvent(
                "data",
                storage.PROVISIONING_FAILED,
                "no volume plugin matched name: kubernetes.io/no-provisioner",
            ),
        ),
    ),
    Case(
        "block-claim-gets-block-volume",
        pvs=(PV("fs", "1Gi"), PV("block", "5Gi", volume_mode="Block")),
        pvcs=(PVC("data", volume_mode="Block"),),
        want_pvs=(WantPV("block", "Bound", "data"), WantPV("fs", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "block"),),
    ),
    Case(
        "filesystem-claim-never-gets-block-volume",
        pvs=(PV("block", "1Gi", volume_mode="Block"), PV("fs", "5Gi", volume_mode="Filesystem")),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("fs", "Bound", "data"), WantPV("block", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "fs"),),
    ),
    Case(
        # kcm searches one access-mode set at a time, fewest modes first: a free volume with just
        # the requested mode wins over a volume pre-bound to the claim offering more modes, which
        # stays Available and reserved (as kcm 1.36 did with the same objects).
        "pre-bound-volume-loses-to-a-narrower-free-one",
        pvs=(
            PV(
                "wide",
                modes=("ReadWriteOnce", "ReadWriteMany"),
                claim="data",
                claim_uid=NO_UID,
                phase="Available",
            ),
            PV("narrow", "2Gi", phase="Available"),
        ),
        pvcs=(PVC("data"),),
        want_pvs=(
            WantPV("narrow", "Bound", "data", "data", {BOUND_BY_CONTROLLER: "yes"}),
            WantPV("wide", "Available", "data", NO_UID),
        ),
        want_pvcs=(WantPVC("data", "Bound", "narrow", CONTROLLER_BOUND),),
    ),
    Case(
        "pre-bound-volume-wins-inside-its-access-mode-set",
        pvs=(
            PV("reserved", "3Gi", claim="data", claim_uid=NO_UID, phase="Available"),
            PV("small", "2Gi", phase="Available"),
        ),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("reserved", "Bound", "data", "data"), WantPV("small", "Available")),
        want_pvcs=(WantPVC("data", "Bound", "reserved"),),
    ),
    Case(
        "two-volumes-pre-bound-to-one-claim",
        pvs=(
            PV("a", claim="data", phase="Available", annotations={BOUND_BY_CONTROLLER: "yes"}),
            PV("b", claim="data", phase="Available", annotations={BOUND_BY_CONTROLLER: "yes"}),
        ),
        pvcs=(PVC("data"),),
        # The claim takes the first by name; the other binding is rolled back.
        want_pvs=(
            WantPV("a", "Bound", "data", "data"),
            WantPV("b", "Available", None, ANY, {BOUND_BY_CONTROLLER: None}),
        ),
        want_pvcs=(WantPVC("data", "Bound", "a"),),
    ),
]

ALL = UNBOUND_CLAIMS + PREBOUND_CLAIMS + BOUND_CLAIMS + VOLUMES + RECLAIM + CLASSES


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
async def test_binder_case(control_plane: ControlPlane, api: ApiClient, namespace: str, case: Case) -> None:
    async with harness(control_plane, api, namespace) as h:
        await h.setup(case)
        await h.start()
        await h.converge(case)


async def test_named_volume_created_later_is_bound(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    case = Case(
        "late-volume",
        want_pvs=(WantPV("late", "Bound", "data", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "late", USER_BOUND),),
    )
    async with harness(control_plane, api, namespace) as h:
        await h.create_pvc(PVC("data", volume="late"))
        await h.start(resync=60)  # the volume's arrival, not a resync, must wake the claim
        await asyncio.sleep(0.5)
        await h.create_pv(PV("late"))
        await h.converge(case, timeout=10)


async def test_default_class_assigned_retroactively(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        await h.create_pvc(PVC("nil-class", cls=None))
        await h.create_pvc(PVC("empty-class", cls=""))
        await h.start(resync=60)
        await asyncio.sleep(0.5)
        await h.create_class(SC("fallback", default=True))
        case = Case(
            "retroactive-default",
            want_pvcs=(
                WantPVC(
                    "nil-class",
                    "Pending",
                    annotations={storage.ANN_STORAGE_PROVISIONER: PROVISIONER},
                    cls="fallback",
                ),
                WantPVC("empty-class", "Pending", cls=""),
            ),
            want_events=(WantEvent("empty-class", names.FAILED_BINDING, names.MSG_NO_CLASS),),
        )
        await h.converge(case)


async def test_stale_cache_never_releases_a_volume(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """The claim exists in the API but the controller's caches lost it (a lagging watch): the
    volume's sync must ask the API and leave the volume Bound."""
    case = Case(
        "stale",
        pvs=(PV("pv1", claim="data", phase="Bound"),),
        pvcs=(PVC("data", volume="pv1", phase="Bound", annotations=BOUND_CLAIM),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1"),),
    )
    async with harness(control_plane, api, namespace) as h:
        await h.setup(case)
        controller = await h.start(resync=60)
        await h.converge(case)
        claim = controller.view.claim(f"{namespace}/data")
        assert claim is not None
        # As if the watch had not delivered the claim yet: gone from both caches, no tombstone.
        controller.claims.store.delete(f"{namespace}/data")
        volume = controller.view.volume(h.pv_name("pv1"))
        assert volume is not None
        await controller.sync_volume(volume)
        pv = await h.pv("pv1")
        assert pv is not None and pv["status"]["phase"] == "Bound"
        assert pv["metadata"]["resourceVersion"] == volume["metadata"]["resourceVersion"], "no write"
        assert controller.view.claim(f"{namespace}/data") is not None, "the API answer refills the view"


@pytest.mark.parametrize("binds_in_flight", [1, 8])
async def test_concurrent_workers_never_bind_a_volume_twice(
    control_plane: ControlPlane, api: ApiClient, namespace: str, binds_in_flight: int
) -> None:
    """Many claims race for fewer identical volumes with many workers: every volume ends with at
    most one claim, and every bound claim with its own volume."""
    async with harness(control_plane, api, namespace) as h:
        for i in range(12):
            await h.create_pv(PV(f"pv{i}"))
        for i in range(20):
            await h.create_pvc(PVC(f"c{i}"))
        await h.start(workers=16, resync=60, binds_in_flight=binds_in_flight)

        async def bound_count() -> list[str]:
            claims = (await api.list_page(PERSISTENT_VOLUME_CLAIMS, namespace))["items"]
            n = sum(1 for c in claims if c.get("status", {}).get("phase") == "Bound")
            return [] if n == 12 else [f"{n} bound"]

        await eventually_async("twelve claims bound", bound_count, 30, satisfied=no_problems)
        await consistently_async("twelve claims still bound", bound_count, 1.0, satisfied=no_problems)
        claims = (await api.list_page(PERSISTENT_VOLUME_CLAIMS, namespace))["items"]
        pvs = [
            p
            for p in (await api.list_page(PERSISTENT_VOLUMES))["items"]
            if p["metadata"]["name"].startswith(h.prefix)
        ]
        bound = {c["spec"]["volumeName"]: c for c in claims if c["spec"].get("volumeName")}
        assert len(bound) == 12 == sum(1 for c in claims if c["status"]["phase"] == "Bound")
        for pv in pvs:
            ref = pv["spec"]["claimRef"]
            claim = bound[pv["metadata"]["name"]]
            assert ref["uid"] == claim["metadata"]["uid"], "volume and claim point at each other"
            assert pv["status"]["phase"] == "Bound"


async def test_a_claim_is_never_bound_before_its_volume(
    control_plane: ControlPlane, api: ApiClient, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The volume's phase and the claim's volumeName are written together; when the volume's
    write fails, the claim's still goes out but its phase does not (kcm's order: volume Bound,
    then claim Bound), and the retry finishes the bind from where it stopped."""
    original_volume_status = PVController._update_volume_status
    original_claim = PVController._update_claim
    original_claim_status = PVController._update_claim_status
    log: list[str] = []

    async def failing_once(self: PVController, volume: Obj) -> PersistentVolume:
        if volume.get("status", {}).get("phase") == "Bound" and "volume phase failed" not in log:
            log.append("volume phase failed")
            raise ApiError(500, {"reason": "InternalError", "message": "injected"}, "PUT", "status")
        return await original_volume_status(self, volume)

    async def claim_spec(self: PVController, claim: Obj) -> PersistentVolumeClaim:
        log.append("claim volumeName")
        return await original_claim(self, claim)

    async def claim_status(self: PVController, claim: Obj) -> PersistentVolumeClaim:
        if claim["status"].get("phase") == "Bound":
            pv = self.view.volume(claim["spec"]["volumeName"])
            assert pv is not None
            log.append(f"claim Bound after volume {pv['status']['phase']}")
        return await original_claim_status(self, claim)

    monkeypatch.setattr(PVController, "_update_volume_status", failing_once)
    monkeypatch.setattr(PVController, "_update_claim", claim_spec)
    monkeypatch.setattr(PVController, "_update_claim_status", claim_status)
    async with harness(control_plane, api, namespace) as h:
        await h.create_pv(PV("pv0"))
        await h.create_pvc(PVC("c0"))
        await h.start(workers=2, resync=60)

        async def unbound() -> list[str]:
            claims = (await api.list_page(PERSISTENT_VOLUME_CLAIMS, namespace))["items"]
            return [c["metadata"]["name"] for c in claims if c.get("status", {}).get("phase") != "Bound"]

        await eventually_async("unbound", unbound, 30, satisfied=no_problems)
        assert sorted(log[:2]) == ["claim volumeName", "volume phase failed"], log
        assert log[2:] == ["claim Bound after volume Bound"], log


@pytest.mark.parametrize("binds_in_flight", [1, 3])
async def test_binds_in_flight_are_bounded(
    control_plane: ControlPlane, api: ApiClient, namespace: str, binds_in_flight: int
) -> None:
    """With eight workers and ten claims queued at once, no more than binds_in_flight new binds
    have their leading writes outstanding at any moment (kcm: one; a bind's last write, the
    claim's phase, may overlap the next bind), and the limit is actually reached; every claim
    still ends Bound."""
    async with harness(control_plane, api, namespace) as h:
        for i in range(10):
            await h.create_pv(PV(f"pv{i}"))
        for i in range(10):
            await h.create_pvc(PVC(f"c{i}"))
        controller = await h.start(workers=8, resync=60, binds_in_flight=binds_in_flight)
        bind = controller._bind
        in_flight, peak = 0, 0

        async def counting_bind(
            volume: PersistentVolume,
            claim: PersistentVolumeClaim,
            before_last_write: Callable[[], None] | None = None,
        ) -> None:
            nonlocal in_flight, peak
            new = BIND_COMPLETED not in (claim["metadata"].get("annotations") or {})
            in_flight += new
            peak = max(peak, in_flight)
            counted = True

            def slot_given_back() -> None:
                nonlocal in_flight, counted
                if counted:
                    counted = False
                    in_flight -= new
                    if before_last_write is not None:
                        before_last_write()

            try:
                await bind(volume, claim, slot_given_back)
            finally:
                slot_given_back()

        controller._bind = counting_bind  # type: ignore[method-assign]

        async def unbound() -> list[str]:
            claims = (await api.list_page(PERSISTENT_VOLUME_CLAIMS, namespace))["items"]
            return [c["metadata"]["name"] for c in claims if c.get("status", {}).get("phase") != "Bound"]

        await eventually_async("unbound", unbound, 30, satisfied=no_problems)
        assert peak == binds_in_flight


async def test_a_lost_claim_is_left_alone_until_its_volume_returns(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """kcm writes nothing to a claim already Lost (not even the access modes and capacity a Lost
    claim should not have) and records no second event; when its volume reappears unbound the
    claim is bound to it again (syncBoundClaim)."""
    async with harness(control_plane, api, namespace) as h:
        claim = await h.create_pvc(PVC("data", volume="gone", annotations=BOUND_CLAIM))
        claim["status"] = {"phase": "Lost", "accessModes": list(RWO), "capacity": {"storage": "1Gi"}}
        claim = await api.update_status(PERSISTENT_VOLUME_CLAIMS, claim)
        await h.start(resync=0.5)

        async def left_alone() -> list[str]:
            still = await h.pvc("data")
            written = still["metadata"]["resourceVersion"] != claim["metadata"]["resourceVersion"]
            events = [e for e in await h.events() if e[0] == "data"]
            return ([f"status written: {still['status']}"] if written else []) + [
                f"event {e}" for e in events
            ]

        # Several resyncs.
        await consistently_async("the Lost claim left alone", left_alone, 2.5, 0.2, satisfied=no_problems)
        # No status of its own: with the controller running, writing one races the controller's
        # (409); the controller makes the new volume Available itself.
        await h.create_pv(PV("gone"))
        case = Case(
            "lost-claim-volume-returns",
            want_pvs=(WantPV("gone", "Bound", "data", "data"),),
            want_pvcs=(WantPVC("data", "Bound", "gone"),),
        )
        await h.converge(case)


async def test_the_apiserver_stamps_the_phase_transition_time(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """The controller sends lastPhaseTransitionTime back unchanged, as kcm does; the apiserver's
    status strategy replaces it when the phase changes."""
    async with harness(control_plane, api, namespace) as h:
        pv = await h.create_pv(PV("pv1"))
        old = "2020-01-02T03:04:05Z"
        pv["status"] = {"phase": "Pending", "lastPhaseTransitionTime": old}
        pv = await api.update_status(PERSISTENT_VOLUMES, pv)
        assert pv["status"]["lastPhaseTransitionTime"] == old, "a client may set it when the phase stays"
        before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
        await h.start()
        await h.converge(Case("available", want_pvs=(WantPV("pv1", "Available"),)))
        available = await h.pv("pv1")
        assert available is not None
        stamped = datetime.datetime.fromisoformat(available["status"]["lastPhaseTransitionTime"])
        assert before <= stamped <= datetime.datetime.now(datetime.UTC)


async def test_a_volume_awaiting_filesystem_expansion_binds_with_its_old_size(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    """The claim's capacity comes from the volume's pre-resize-capacity annotation, so the node
    still grows the filesystem (kcm's updateClaimStatus)."""
    case = Case(
        "pre-resize",
        pvs=(PV("pv1", "2Gi", annotations={names.ANN_PRE_RESIZE_CAPACITY: "1Gi"}),),
        pvcs=(PVC("data"),),
        want_pvs=(WantPV("pv1", "Bound", "data", "data"),),
        want_pvcs=(WantPVC("data", "Bound", "pv1"),),
    )
    async with harness(control_plane, api, namespace) as h:
        await h.setup(case)
        await h.start()
        await h.converge(case)
        assert (await h.pvc("data"))["status"]["capacity"] == {"storage": "1Gi"}
