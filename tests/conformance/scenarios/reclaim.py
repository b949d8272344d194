"""Reclaiming released volumes: kubernetes pkg/controller/volume/persistentvolume delete_test.go and
recycle_test.go, and the deletion half of kubernetes-csi external-provisioner controller_test.go,
including static CSI volumes with reclaimPolicy Delete."""

from __future__ import annotations

from ..build import (
    ANN_PROVISIONED_BY,
    bound,
    delete,
    event,
    gone,
    patch,
    phase,
    pv,
    pvc,
    sc,
    secret,
    sleep,
    wait,
)
from ..model import DriverVolume, Scenario, Step
from .provisioning import SECRET_PARAMS

DT = "delete_test.go"
DRIVER = "loop.csi.kubeloop.dev"
# Long enough for the binder and the sidecar to act on a released volume and report.
REACT = 8.0


def claim_of(volume: str, claim: str = "claim1") -> tuple[Step, ...]:
    """The claim a pre-bound static volume waits for, bound."""
    return pvc(claim, volume=volume), wait(bound(claim))


def release(claim: str) -> tuple[Step, ...]:
    """The claim deleted and gone: its volume is Released and up for reclaiming."""
    return delete("pvc", claim), wait(gone("pvc", claim))


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "reclaim-delete-provisioned",
        f"{DT}: 8-1 successful delete of a provisioned volume",
        (
            pvc("claim1", sc="kubeloop"),
            wait(bound("claim1")),
            *release("claim1"),
            sleep(1),
            wait(gone("pv", "claim:claim1")),
        ),
        subset=True,
    ),
    Scenario(
        "reclaim-retain-provisioned",
        f"{DT}: a provisioned volume of a Retain class is Released, not deleted",
        (
            sc("keep", reclaim="Retain"),
            pvc("claim1", sc="keep"),
            wait(bound("claim1")),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-delete-static-csi-unknown-handle",
        f"{DT}: 8-x a static CSI volume with reclaimPolicy Delete (no provisioned-by annotation)",
        (
            pv("pv1", reclaim="Delete", claim="claim1"),
            *claim_of("pv1"),
            *release("claim1"),
            sleep(REACT),
        ),
        subset=True,
    ),
    Scenario(
        "reclaim-delete-static-csi-real-volume",
        f"{DT}: a static CSI volume of a real driver volume with reclaimPolicy Delete",
        (
            DriverVolume("d1"),
            pv("pv1", reclaim="Delete", claim="claim1", vol="d1"),
            *claim_of("pv1"),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-delete-static-annotated",
        f"{DT}: a static volume annotated as provisioned by the driver is deleted by the sidecar",
        (
            DriverVolume("d1"),
            pv("pv1", reclaim="Delete", claim="claim1", vol="d1", annotations={ANN_PROVISIONED_BY: DRIVER}),
            *claim_of("pv1"),
            delete("pvc", "claim1"),
            wait(gone("pv", "pv1"), timeout=30),
        ),
    ),
    Scenario(
        "reclaim-delete-static-annotated-unknown-handle",
        f"{DT}: the driver does not know the annotated volume (DeleteVolume of a missing id succeeds)",
        (
            pv("pv1", reclaim="Delete", claim="claim1", annotations={ANN_PROVISIONED_BY: DRIVER}),
            *claim_of("pv1"),
            delete("pvc", "claim1"),
            wait(gone("pv", "pv1"), timeout=30),
        ),
    ),
    Scenario(
        "reclaim-delete-other-provisioner",
        f"{DT}: 8-x a volume provisioned by another provisioner is left to it",
        (
            pv(
                "pv1", reclaim="Delete", claim="claim1", annotations={ANN_PROVISIONED_BY: "example.com/other"}
            ),
            *claim_of("pv1"),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-retain-static-then-admin-delete",
        f"{DT}: a Released Retain volume deleted by the admin goes away",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(bound("claim1")),
            delete("pvc", "claim1"),
            wait(phase("pv", "pv1", "Released")),
            delete("pv", "pv1"),
            wait(gone("pv", "pv1")),
        ),
    ),
    Scenario(
        "reclaim-delete-class-deleted",
        f"{DT}: deleting a provisioned volume whose class is gone",
        (
            sc("temp"),
            pvc("claim1", sc="temp"),
            wait(bound("claim1")),
            delete("sc", "temp"),
            sleep(1),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-delete-with-secrets",
        f"{DT}: deletion secrets recorded at provisioning are used to delete",
        (
            secret("creds", user="u"),
            sc("secret", params=SECRET_PARAMS),
            pvc("claim1", sc="secret"),
            wait(bound("claim1")),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-delete-pv-first",
        "pv-protection: a bound provisioned volume deleted first, then its claim",
        (
            pvc("claim1", sc="kubeloop"),
            wait(bound("claim1")),
            delete("pv", "claim:claim1"),
            sleep(2),
            *release("claim1"),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-retain-provisioned-admin-delete",
        f"{DT}: a Released volume of a Retain class deleted by the admin",
        (
            sc("keep", reclaim="Retain"),
            pvc("claim1", sc="keep"),
            wait(bound("claim1")),
            delete("pvc", "claim1"),
            wait(phase("pv", "claim:claim1", "Released")),
            delete("pv", "claim:claim1"),
            wait(gone("pv", "claim:claim1")),
        ),
    ),
    Scenario(
        "reclaim-recycle-rejected",
        "recycle_test.go: Recycle is not a valid policy for a CSI volume",
        (pv("pv1", reclaim="Recycle"), sleep(1)),
    ),
    Scenario(
        "reclaim-failed-volume-policy-changed",
        f"{DT}: a volume that failed to delete, set to Retain by the admin",
        (
            pv("pv1", reclaim="Delete", claim="claim1"),
            *claim_of("pv1"),
            *release("claim1"),
            sleep(REACT),
            patch("pv", "pv1", {"spec": {"persistentVolumeReclaimPolicy": "Retain"}}),
            sleep(REACT),
        ),
    ),
    Scenario(
        "reclaim-delete-failed-event",
        f"{DT}: 8-3 a delete that fails is reported on the volume",
        (
            pv("pv1", reclaim="Delete", claim="claim1"),
            *claim_of("pv1"),
            delete("pvc", "claim1"),
            wait(event("pv", "pv1", "VolumeFailedDelete"), timeout=30),
            sleep(2),
        ),
    ),
)
