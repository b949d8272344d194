"""Pure matching logic of the pv-controller: quantities, selectors, the access-mode index and the
binding choice."""

from __future__ import annotations

from typing import Any

import pytest

from controller_runtime import storage
from controller_runtime.kinds import (
    LabelSelectorRequirement,
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    pv_view,
    pvc_view,
)
from controller_runtime.quantity import parse_quantity
from controller_runtime.resources import Obj
from controller_runtime.storage import access_modes_key, claim_class, claim_has_class
from services.pv_controller.match import (
    VolumeIndex,
    check_volume_satisfies_claim,
    default_class,
    find_best_match,
    selector_matches,
)


def pv(
    name: str, size: str = "1Gi", modes: tuple[str, ...] = ("ReadWriteOnce",), **kw: Any
) -> PersistentVolume:
    obj: Obj = {
        "metadata": {"name": name, "labels": kw.pop("labels", {}), "annotations": kw.pop("annotations", {})},
        "spec": {"capacity": {"storage": size}, "accessModes": list(modes), **kw.pop("spec", {})},
        "status": {"phase": kw.pop("phase", "Available")},
    }
    if "claim" in kw:
        obj["spec"]["claimRef"] = {"namespace": "ns", "name": kw.pop("claim"), "uid": kw.pop("uid", "")}
    assert not kw, kw
    return pv_view(obj)


def pvc(size: str = "1Gi", modes: tuple[str, ...] = ("ReadWriteOnce",), **spec: Any) -> PersistentVolumeClaim:
    return pvc_view(
        {
            "metadata": {"name": "data", "namespace": "ns", "uid": "u1"},
            "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": size}}, **spec},
        }
    )


def best(
    claim: PersistentVolumeClaim,
    volumes: list[PersistentVolume],
    delay: bool = False,
    reserved: frozenset[str] = frozenset(),
) -> str | None:
    index = VolumeIndex()
    by_name = {v["metadata"]["name"]: v for v in volumes}
    for v in volumes:
        index.upsert(v)
    found = find_best_match(claim, index, by_name.get, delay, lambda n: n in reserved)
    return None if found is None else str(found["metadata"]["name"])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Gi", 2**30),
        ("500Mi", 500 * 2**20),
        ("1G", 10**9),
        ("1.5Gi", 3 * 2**29),
        ("100m", 1),  # Value() rounds up
        ("1e3", 1000),
        ("1024", 1024),
        ("", 0),
        ("garbage", 0),
    ],
)
def test_parse_quantity(text: str, value: int) -> None:
    assert parse_quantity(text) == value


def test_access_modes_key_is_canonical() -> None:
    assert access_modes_key(["ReadWriteMany", "ReadWriteOnce"]) == "RWO,RWX"
    assert access_modes_key(["ReadWriteOncePod"]) == "RWOP"
    assert access_modes_key([]) == ""


def test_selector_semantics() -> None:
    labels = {"tier": "gold", "zone": "a"}
    assert selector_matches(None, labels)
    assert selector_matches({"matchLabels": {"tier": "gold"}}, labels)
    assert not selector_matches({"matchLabels": {"tier": "silver"}}, labels)
    expr: LabelSelectorRequirement = {"key": "zone", "operator": "In", "values": ["a", "b"]}
    assert selector_matches({"matchExpressions": [expr]}, labels)
    assert not selector_matches({"matchExpressions": [{**expr, "operator": "NotIn"}]}, labels)
    assert selector_matches({"matchExpressions": [{"key": "x", "operator": "DoesNotExist"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Exists"}]}, labels)
    assert not selector_matches({"matchExpressions": [{"key": "x", "operator": "Gt"}]}, labels)


def test_smallest_fit_wins() -> None:
    assert best(pvc("1Gi"), [pv("big", "10Gi"), pv("fit", "2Gi"), pv("small", "500Mi")]) == "fit"


def test_fewest_access_modes_before_smallest() -> None:
    volumes = [pv("rwo-rwx", "1Gi", ("ReadWriteOnce", "ReadWriteMany")), pv("rwo", "5Gi")]
    assert best(pvc("1Gi"), volumes) == "rwo"
    # A claim asking for RWX can only use the wider bucket.
    assert best(pvc("1Gi", ("ReadWriteMany",)), volumes) == "rwo-rwx"


def test_index_orders_buckets_by_mode_count_then_key() -> None:
    index = VolumeIndex()
    index.upsert(pv("a", modes=("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany")))
    index.upsert(pv("b", modes=("ReadWriteOnce",)))
    index.upsert(pv("c", modes=("ReadWriteOnce", "ReadWriteMany")))
    index.upsert(pv("d", modes=("ReadWriteOnce", "ReadOnlyMany")))
    assert index.buckets_for(["ReadWriteOnce"]) == ["RWO", "RWO,ROX", "RWO,RWX", "RWO,ROX,RWX"]
    assert index.buckets_for(["ReadWriteMany"]) == ["RWO,RWX", "RWO,ROX,RWX"]


def test_index_keeps_capacity_order_and_forgets_claimed_volumes() -> None:
    index = VolumeIndex()
    for name, size in (("c", "3Gi"), ("a", "1Gi"), ("b", "2Gi")):
        index.upsert(pv(name, size))
    assert list(index.free_at_least("RWO", 2**30 + 1)) == ["b", "c"]
    index.upsert(pv("b", "2Gi", claim="data"))  # now claimed: out of the free bucket
    assert list(index.free_at_least("RWO", 0)) == ["a", "c"]
    assert index.bound_to("ns/data") == ["b"]
    index.remove("b")
    assert index.bound_to("ns/data") == []
    index.remove("a")
    index.remove("c")
    assert index.buckets_for([]) == []


def test_non_available_volumes_are_skipped() -> None:
    assert best(pvc(), [pv("pending", phase="Pending"), pv("ok", "5Gi")]) == "ok"
    assert best(pvc(), [pv("pending", phase="Pending")]) is None


def test_prebound_volume_wins_over_a_better_fit() -> None:
    volumes = [pv("exact"), pv("reserved", "5Gi", claim="data", phase="Pending")]
    assert best(pvc(), volumes) == "reserved"
    assert best(pvc(), volumes, delay=True) == "reserved", "pre-bound volumes bind even when delayed"
    other = [pv("reserved", "5Gi", claim="data", uid="another-uid")]
    assert best(pvc(), other) is None, "a claimRef with another UID is not ours"


def test_prebound_volume_wins_only_inside_its_access_mode_set() -> None:
    # kcm searches one access-mode set at a time, fewest modes first (index.go findByClaim): a free
    # RWO volume beats a volume pre-bound to the claim that offers RWO+RWX, measured against kcm
    # 1.36 (the claim was bound to the free volume, the pre-bound one stayed Available).
    wide = pv("wide", modes=("ReadWriteOnce", "ReadWriteMany"), claim="data")
    narrow = pv("narrow", "2Gi")
    assert best(pvc(), [wide, narrow]) == "narrow"
    # Inside one set the pre-bound volume wins over a smaller free one (also measured).
    assert best(pvc(), [pv("reserved", "3Gi", claim="data"), pv("small", "2Gi")]) == "reserved"
    # With nothing free in the narrower set, the search reaches the pre-bound volume's set.
    assert best(pvc(), [wide, pv("taken", claim="other", uid="x")]) == "wide"
    # Delayed binding skips free volumes but still takes a pre-bound one in a later set.
    assert best(pvc(), [wide, narrow], delay=True) == "wide"
    # A wider set only offering the requested modes partially is never searched.
    assert (
        best(pvc(modes=("ReadWriteMany",)), [narrow, pv("rox", modes=("ReadOnlyMany",), claim="data")])
        is None
    )


def test_prebound_volume_still_has_to_fit() -> None:
    assert best(pvc("2Gi"), [pv("reserved", "1Gi", claim="data")]) is None
    block = pv("reserved", claim="data", spec={"volumeMode": "Block"})
    assert best(pvc(), [block]) is None


def test_delay_binding_never_picks_a_free_volume() -> None:
    assert best(pvc(), [pv("free")], delay=True) is None


def test_filters_class_mode_selector_deletion_and_reservation() -> None:
    assert (
        best(pvc(storageClassName="gold"), [pv("plain"), pv("gold", spec={"storageClassName": "gold"})])
        == "gold"
    )
    assert best(pvc(volumeMode="Block"), [pv("fs"), pv("blk", spec={"volumeMode": "Block"})]) == "blk"
    assert best(pvc(), [pv("blk", spec={"volumeMode": "Block"})]) is None
    sel = {"matchLabels": {"tier": "gold"}}
    assert best(pvc(selector=sel), [pv("plain"), pv("gold", "2Gi", labels={"tier": "gold"})]) == "gold"
    deleting = pv("deleting")
    deleting["metadata"]["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    assert best(pvc(), [deleting]) is None
    assert best(pvc(), [pv("a"), pv("b", "2Gi")], reserved=frozenset({"a"})) == "b"


def test_nil_and_empty_class_are_the_same() -> None:
    claim = pvc()
    assert claim_class(claim) == "" and not claim_has_class(claim)
    assert claim_has_class(pvc(storageClassName=""))
    beta = pvc(storageClassName="x")
    beta["metadata"]["annotations"] = {storage.ANN_BETA_STORAGE_CLASS: "beta"}
    assert claim_class(beta) == "beta", "the beta annotation wins over the field"
    assert best(pvc(), [pv("unset")]) == "unset"
    assert best(pvc(storageClassName=""), [pv("empty", spec={"storageClassName": ""})]) == "empty"


@pytest.mark.parametrize(
    ("volume", "claim", "problem"),
    [
        (pv("v", "1Gi"), pvc("2Gi"), "requested PV is too small"),
        (pv("v", spec={"storageClassName": "gold"}), pvc(), "storageClassName does not match"),
        (pv("v", spec={"volumeMode": "Block"}), pvc(), "incompatible volumeMode"),
        (pv("v"), pvc(modes=("ReadWriteMany",)), "incompatible accessMode"),
        # kcm compares VolumeAttributesClass names with nil read as "", after the class and
        # before the volume mode.
        (pv("v"), pvc(volumeAttributesClassName="gold"), "volumeAttributesClassName does not match"),
        (pv("v", spec={"volumeAttributesClassName": "x"}), pvc(), "volumeAttributesClassName does not match"),
        (
            pv("v", spec={"volumeAttributesClassName": "gold", "volumeMode": "Block"}),
            pvc(volumeAttributesClassName="silver"),
            "volumeAttributesClassName does not match",
        ),
        (pv("v", spec={"volumeAttributesClassName": "gold"}), pvc(volumeAttributesClassName="gold"), None),
        (pv("v", spec={"volumeAttributesClassName": ""}), pvc(), None),
        (pv("v", "5Gi"), pvc(), None),
    ],
)
def test_check_volume_satisfies_claim(
    volume: PersistentVolume, claim: PersistentVolumeClaim, problem: str | None
) -> None:
    assert check_volume_satisfies_claim(volume, claim) == problem


def test_default_class_newest_then_name() -> None:
    def sc(name: str, ts: str, default: bool = True) -> StorageClass:
        ann = {storage.ANN_DEFAULT_CLASS: "true"} if default else {}
        return {"metadata": {"name": name, "creationTimestamp": ts, "annotations": ann}}

    assert default_class([sc("a", "2024-01-01T00:00:00Z", default=False)]) is None
    classes = [
        sc("old", "2024-01-01T00:00:00Z"),
        sc("new-b", "2024-02-01T00:00:00Z"),
        sc("new-a", "2024-02-01T00:00:00Z"),
    ]
    chosen = default_class(classes)
    assert chosen is not None and chosen["metadata"]["name"] == "new-a"
