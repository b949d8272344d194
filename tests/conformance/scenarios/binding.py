"""Static binding: the syncClaim / syncVolume branches of kubernetes
pkg/controller/volume/persistentvolume (binder_test.go, index_test.go): matching by size, access
modes, volume mode, class and selector; pre-bound claims and volumes; Lost and Misbound claims."""

from __future__ import annotations

from ..build import (
    ANN_BOUND_BY_CONTROLLER,
    RWO,
    RWX,
    STALE_UID,
    bound,
    delete,
    event,
    field,
    patch,
    phase,
    pv,
    pvc,
    sc,
    sleep,
    wait,
)
from ..model import Scenario

BT = "binder_test.go"
# The binder retries an unbound claim on its resync (15s in both modes) when a volume comes later.
RESYNC_WAIT = 40.0
# A claim that must stay unbound: long enough for one binder pass and its events.
PENDING = 4.0

SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "bind-claim-to-available-volume",
        f"{BT}: 1-3 syncClaim binds to a matching volume",
        (pv("pv1"), pvc("claim1"), wait(bound("claim1"), phase("pv", "pv1", "Bound"))),
        subset=True,
    ),
    Scenario(
        "bind-volume-created-after-claim",
        f"{BT}: 1-1 syncClaim with no volume, then the volume appears (resync)",
        (pvc("claim1"), sleep(PENDING), pv("pv1"), wait(bound("claim1"), timeout=RESYNC_WAIT)),
    ),
    Scenario(
        "claim-no-matching-size",
        f"{BT}: 1-2 syncClaim no matching volume (too small)",
        (pv("pv1", "1Gi"), pvc("claim1", "2Gi"), sleep(PENDING)),
        subset=True,
    ),
    Scenario(
        "claim-picks-smallest-volume",
        "index_test.go: findBestMatch takes the smallest volume that is large enough",
        (
            pv("pv-big", "10Gi"),
            pv("pv-small", "2Gi"),
            pv("pv-tiny", "1Gi"),
            pvc("claim1", "2Gi"),
            wait(bound("claim1")),
        ),
    ),
    Scenario(
        "claim-access-mode-mismatch",
        "index_test.go: access modes must contain the claim's",
        (pv("pv1", modes=RWO), pvc("claim1", modes=RWX), sleep(PENDING)),
    ),
    Scenario(
        "claim-access-mode-superset",
        "index_test.go: a volume with more modes than the claim asks matches",
        (pv("pv1", modes=("ReadWriteOnce", "ReadOnlyMany")), pvc("claim1", modes=RWO), wait(bound("claim1"))),
    ),
    Scenario(
        "claim-volume-mode-mismatch",
        f"{BT}: 1-8 volume mode mismatch: Block volume, Filesystem claim",
        (pv("pv1", block=True), pvc("claim1"), sleep(PENDING)),
    ),
    Scenario(
        "claim-block-binds-block",
        f"{BT}: 1-9 Block claim binds a Block volume",
        (pv("pv-fs"), pv("pv-block", block=True), pvc("claim1", block=True), wait(bound("claim1"))),
    ),
    Scenario(
        "claim-selector-match",
        f"{BT}: 1-4 syncClaim with a label selector",
        (
            pv("pv-plain"),
            pv("pv-labelled", labels={"tier": "gold"}),
            pvc("claim1", selector={"matchLabels": {"tier": "gold"}}),
            wait(bound("claim1")),
        ),
    ),
    Scenario(
        "claim-selector-no-match",
        f"{BT}: 1-5 syncClaim with a selector nothing matches",
        (
            pv("pv1", labels={"tier": "bronze"}),
            pvc("claim1", selector={"matchLabels": {"tier": "gold"}}),
            sleep(PENDING),
        ),
    ),
    Scenario(
        "claim-selector-expression",
        "index_test.go: matchExpressions selectors",
        (
            pv("pv1", labels={"tier": "silver"}),
            pv("pv2", labels={"tier": "gold"}),
            pvc(
                "claim1",
                selector={"matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}]},
            ),
            wait(bound("claim1")),
        ),
    ),
    Scenario(
        "claim-class-match",
        f"{BT}: 1-10 claim and volume of the same (absent) class bind",
        (pv("pv-none"), pv("pv-gold", sc="gold"), pvc("claim1", sc="gold"), wait(bound("claim1"))),
    ),
    Scenario(
        "claim-class-missing-no-volume",
        f"{BT}: 11-12 unbound claim of a class that does not exist",
        (pv("pv1", sc="gold"), pvc("claim1", sc="silver"), sleep(PENDING)),
        subset=True,
    ),
    Scenario(
        "claim-empty-class-does-not-bind-classed-volume",
        'index_test.go: a volume with a class does not match a claim with class ""',
        (pv("pv1", sc="gold"), pvc("claim1", sc=""), sleep(PENDING)),
    ),
    Scenario(
        "prebound-claim-available-volume",
        f"{BT}: 1-6 claim pre-bound to an available volume",
        (pv("pv1"), pv("pv2"), pvc("claim1", volume="pv2"), wait(bound("claim1"))),
        subset=True,
    ),
    Scenario(
        "prebound-claim-volume-missing",
        f"{BT}: 2-1 claim pre-bound to a volume that does not exist",
        (pvc("claim1", volume="nosuch"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-claim-volume-appears",
        f"{BT}: 2-2 claim pre-bound to a volume created later",
        (pvc("claim1", volume="pv1"), sleep(PENDING), pv("pv1"), wait(bound("claim1"), timeout=RESYNC_WAIT)),
    ),
    Scenario(
        "prebound-claim-volume-bound-elsewhere",
        f"{BT}: 2-5 claim pre-bound to a volume bound to another claim",
        (
            pv("pv1", claim="other"),
            pvc("other"),
            wait(bound("other")),
            pvc("claim1", volume="pv1"),
            sleep(PENDING),
        ),
    ),
    Scenario(
        "prebound-claim-too-small-volume",
        f"{BT}: 2-7 claim pre-bound to a volume that is too small",
        (pv("pv1", "1Gi"), pvc("claim1", "5Gi", volume="pv1"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-claim-volume-mode-mismatch",
        f"{BT}: 2-9 claim pre-bound to a volume of another volume mode",
        (pv("pv1", block=True), pvc("claim1", volume="pv1"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-claim-class-mismatch",
        f"{BT}: 2-8 claim pre-bound to a volume of another class",
        (pv("pv1", sc="gold"), pvc("claim1", volume="pv1"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-claim-access-mode-mismatch",
        "checkVolumeSatisfyClaim: incompatible access modes of a pre-bound pair",
        (pv("pv1", modes=RWO), pvc("claim1", modes=RWX, volume="pv1"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-volume-claim-appears",
        f"{BT}: 1-7 volume pre-bound to a claim, claim created after",
        (pv("pv1", claim="claim1"), sleep(PENDING), pvc("claim1"), wait(bound("claim1"))),
        subset=True,
    ),
    Scenario(
        "prebound-volume-claim-missing",
        f"{BT}: 4-2 volume pre-bound to a claim that does not exist stays Available",
        (pv("pv1", claim="claim1"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-volume-not-taken-by-other-claim",
        "index_test.go: a volume pre-bound to one claim is not matched by another",
        (pv("pv1", claim="claim1"), pvc("claim2"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-volume-stale-uid-released",
        f"{BT}: 4-5 volume bound to a claim UID that is gone is Released",
        (pvc("claim1"), sleep(1), pv("pv1", claim="claim1", claim_uid=STALE_UID), sleep(PENDING)),
    ),
    Scenario(
        "prebound-volume-too-small-for-claim",
        "index_test.go: a volume pre-bound to a claim but too small",
        (pv("pv1", "1Gi", claim="claim1"), pvc("claim1", "5Gi"), sleep(PENDING)),
    ),
    Scenario(
        "prebound-both-sides",
        f"{BT}: 3-1 claim and volume pre-bound to each other",
        (pv("pv1", claim="claim1"), pvc("claim1", volume="pv1"), wait(bound("claim1"))),
    ),
    Scenario(
        "claim-lost-volume-deleted",
        f"{BT}: 3-2 bound claim whose volume is gone becomes Lost",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(bound("claim1")),
            delete("pv", "pv1"),
            patch("pv", "pv1", {"metadata": {"finalizers": None}}),
            wait(phase("pvc", "claim1", "Lost"), timeout=RESYNC_WAIT),
        ),
        subset=True,
    ),
    Scenario(
        "claim-bound-annotation-volume-missing",
        f"{BT}: 3-3 claim marked bound to a volume that does not exist",
        (
            pvc("claim1", volume="nosuch", annotations={"pv.kubernetes.io/bind-completed": "yes"}),
            wait(phase("pvc", "claim1", "Lost"), timeout=RESYNC_WAIT),
        ),
    ),
    Scenario(
        "claim-misbound",
        f"{BT}: 3-5 claim bound to a volume bound to another claim (Misbound)",
        (
            pv("pv1", claim="other"),
            pvc("other"),
            wait(bound("other")),
            pvc("claim1", volume="pv1", annotations={"pv.kubernetes.io/bind-completed": "yes"}),
            wait(event("pvc", "claim1", "ClaimMisbound"), timeout=RESYNC_WAIT),
            sleep(2),
        ),
    ),
    Scenario(
        "lost-claim-stays-lost",
        "syncBoundClaim: a Lost claim is not rewritten when nothing changes",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(bound("claim1")),
            delete("pv", "pv1"),
            patch("pv", "pv1", {"metadata": {"finalizers": None}}),
            wait(phase("pvc", "claim1", "Lost"), timeout=RESYNC_WAIT),
            sleep(18),
        ),
    ),
    Scenario(
        "released-volume-made-available",
        f"{BT}: 5-x an admin clears the claimRef of a Released volume",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(bound("claim1")),
            delete("pvc", "claim1"),
            wait(phase("pv", "pv1", "Released")),
            patch("pv", "pv1", {"spec": {"claimRef": None}}),
            wait(phase("pv", "pv1", "Available")),
        ),
    ),
    Scenario(
        "released-volume-not-rebound-to-new-claim",
        "syncVolume: a Released volume keeps its claimRef (old UID); a new claim of that name waits",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(bound("claim1")),
            delete("pvc", "claim1"),
            wait(phase("pv", "pv1", "Released")),
            pvc("claim1"),
            sleep(PENDING),
        ),
    ),
    Scenario(
        "bound-by-controller-annotations",
        "bindVolumeToClaim/bindClaimToVolume: annotations of a controller-made bind",
        (
            pv("pv1"),
            pvc("claim1"),
            wait(
                bound("claim1"), field("pv", "pv1", f"metadata.annotations.{ANN_BOUND_BY_CONTROLLER}", "yes")
            ),
        ),
    ),
    Scenario(
        "two-claims-two-volumes",
        "syncClaim: each claim gets its own volume",
        (
            pv("pv1", "1Gi"),
            pv("pv2", "5Gi"),
            pvc("claim-small", "1Gi"),
            pvc("claim-big", "5Gi"),
            wait(bound("claim-small"), bound("claim-big")),
        ),
    ),
    Scenario(
        "claim-default-class-unset",
        "retroactive default class: a claim without storageClassName gets the default class",
        (pvc("claim1", sc=None), wait(bound("claim1"))),
    ),
    Scenario(
        "volume-with-immediate-class-static",
        "syncClaim: a static volume of an existing Immediate class binds before provisioning",
        (sc("fast"), pv("pv1", sc="fast"), pvc("claim1", sc="fast"), wait(bound("claim1"))),
    ),
    Scenario(
        "volume-deleted-while-bound-protected",
        "pv-protection: a bound volume deleted by the admin stays Terminating, the claim Bound",
        (pv("pv1"), pvc("claim1"), wait(bound("claim1")), delete("pv", "pv1"), sleep(PENDING)),
    ),
)
