"""Volume expansion: kubernetes pkg/controller/volume/expand (expand_controller_test.go: the hand-off
to the CSI resizer), kubernetes-csi external-resizer (controller_test.go: controller expansion,
FileSystemResizePending, failures and recovery) and the node side through our node agent."""

from __future__ import annotations

from ..build import (
    bound,
    event,
    field,
    pod,
    pv,
    pvc,
    resize,
    running,
    sc,
    sleep,
    wait,
)
from ..model import Condition, DriverVolume, Kill, Observe, Restart, Scenario, Step

ET = "expand_controller_test.go"
RT = "external-resizer controller_test.go"
POD_WAIT = 90.0


def pv_size(claim: str, size: str) -> Condition:
    return field("pv", f"claim:{claim}", "spec.capacity.storage", size)


def claim_size(claim: str, size: str) -> Condition:
    return field("pvc", claim, "status.capacity.storage", size)


def grown() -> tuple[Step, ...]:
    """claim1 provisioned, then grown from 1Gi to 2Gi by the controller side."""
    return (
        pvc("claim1", sc="kubeloop"),
        wait(bound("claim1")),
        resize("claim1", "2Gi"),
        wait(pv_size("claim1", "2Gi"), timeout=30),
    )


def failed_expansion() -> tuple[Step, ...]:
    """claim1 provisioned, then asked to grow beyond what the driver's pool holds."""
    return (
        pvc("claim1", sc="kubeloop"),
        wait(bound("claim1")),
        resize("claim1", "100Ti"),
        wait(event("pvc", "claim1", "VolumeResizeFailed"), timeout=30),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "expand-unattached-claim",
        f"{ET}+{RT}: controller expansion of a claim no pod uses",
        (
            *grown(),
            sleep(3),
        ),
        subset=True,
    ),
    Scenario(
        "expand-with-pod",
        f"{RT}: controller then node expansion of a mounted volume",
        (
            pvc("claim1", sc="kubeloop-wffc"),
            pod("p1", "claim1", on="node-a"),
            wait(running("p1"), timeout=POD_WAIT),
            resize("claim1", "2Gi"),
            wait(claim_size("claim1", "2Gi"), timeout=60),
            sleep(2),
        ),
        subset=True,
    ),
    Scenario(
        "expand-class-disallows",
        "admission: a claim of a class without allowVolumeExpansion cannot grow",
        (
            sc("fixed", expand=False),
            pvc("claim1", sc="fixed"),
            wait(bound("claim1")),
            resize("claim1", "2Gi"),
            sleep(2),
        ),
    ),
    Scenario(
        "expand-static-no-class",
        "admission: a claim without a class cannot grow",
        (pv("pv1"), pvc("claim1"), wait(bound("claim1")), resize("claim1", "2Gi"), sleep(2)),
    ),
    Scenario(
        "expand-shrink-rejected",
        "validation: a claim's request cannot go below its capacity",
        (pvc("claim1", "2Gi", sc="kubeloop"), wait(bound("claim1")), resize("claim1", "1Gi"), sleep(2)),
    ),
    Scenario(
        "expand-block",
        f"{RT}: a Block volume",
        (
            pvc("claim1", sc="kubeloop", block=True),
            wait(bound("claim1")),
            resize("claim1", "2Gi"),
            wait(pv_size("claim1", "2Gi"), timeout=30),
            sleep(3),
        ),
    ),
    Scenario(
        "expand-too-large-fails",
        f"{RT}: ControllerExpandVolume fails (larger than the pool)",
        (
            *failed_expansion(),
            sleep(3),
        ),
    ),
    Scenario(
        "expand-recover-from-failure",
        f"{RT}: after a failed expansion the request is lowered again (RecoverVolumeExpansionFailure)",
        (
            *failed_expansion(),
            resize("claim1", "2Gi"),
            wait(pv_size("claim1", "2Gi"), timeout=30),
            sleep(3),
        ),
    ),
    Scenario(
        "expand-twice",
        f"{RT}: two expansions one after the other",
        (
            *grown(),
            resize("claim1", "3Gi"),
            wait(pv_size("claim1", "3Gi"), timeout=30),
            sleep(3),
        ),
    ),
    Scenario(
        "expand-resizer-down",
        f"{ET}: the expansion waits for the resizer and completes when it is back",
        (
            pvc("claim1", sc="kubeloop"),
            wait(bound("claim1")),
            Kill("resizer"),
            resize("claim1", "2Gi"),
            sleep(5),
            Observe("resizer-down"),
            Restart("resizer"),
            wait(pv_size("claim1", "2Gi"), timeout=60),
            sleep(3),
        ),
        exclusive=True,
    ),
    Scenario(
        "expand-static-volume-of-expandable-class",
        f"{ET}: a static volume whose class allows expansion",
        (
            sc("grow"),
            DriverVolume("d1"),
            pv("pv1", sc="grow", claim="claim1", vol="d1"),
            pvc("claim1", sc="grow", volume="pv1"),
            wait(bound("claim1")),
            resize("claim1", "2Gi"),
            wait(field("pv", "pv1", "spec.capacity.storage", "2Gi"), timeout=30),
            sleep(3),
        ),
    ),
)
