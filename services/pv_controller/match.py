"""Pure matching logic: volume modes, selectors, the default class, and the volume index that
finds the best PersistentVolume for a claim (docs/contracts.md, "Binding choice").

Nothing here talks to the API: every function takes objects as their typed views
(controller_runtime.kinds) and returns a value, so the decisions are unit-tested without a server.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from controller_runtime import storage
from controller_runtime.kinds import LabelSelector, PersistentVolume, PersistentVolumeClaim, StorageClass
from controller_runtime.resources import key_of, reference_key
from controller_runtime.storage import (
    access_modes_key,
    claim_class,
    claim_request,
    contains_access_modes,
    is_deleting,
    modes_of_key,
    volume_capacity,
    volume_class,
)

# -- modes and selectors --------------------------------------------------------------------------


def volume_mode_mismatch(claim: PersistentVolumeClaim, volume: PersistentVolume) -> bool:
    """nil volumeMode means Filesystem on both sides."""
    want = claim.get("spec", {}).get("volumeMode") or "Filesystem"
    have = volume.get("spec", {}).get("volumeMode") or "Filesystem"
    return bool(want != have)


def attributes_class_mismatch(claim: PersistentVolumeClaim, volume: PersistentVolume) -> bool:
    want = claim.get("spec", {}).get("volumeAttributesClassName") or ""
    have = volume.get("spec", {}).get("volumeAttributesClassName") or ""
    return bool(want != have)


def selector_matches(selector: LabelSelector | None, labels: dict[str, str]) -> bool:
    """metav1.LabelSelector semantics: matchLabels AND every matchExpression; an empty selector
    matches everything."""
    if not selector:
        return True
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values") or []
        if op == "In":
            if key not in labels or labels[key] not in values:
                return False
        elif op == "NotIn":
            if key in labels and labels[key] in values:
                return False
        elif op == "Exists":
            if key not in labels:
                return False
        elif op == "DoesNotExist":
            if key in labels:
                return False
        else:
            return False  # an operator we do not know can never be satisfied
    return True


# -- claim <-> volume links -------------------------------------------------------------------------


def claim_ref_key(volume: PersistentVolume) -> str | None:
    ref = volume.get("spec", {}).get("claimRef")
    if not ref:
        return None
    return reference_key(ref)


def is_bound_to_claim(volume: PersistentVolume, claim: PersistentVolumeClaim) -> bool:
    """The volume points at this claim by name, and by UID when the reference carries one."""
    ref = volume.get("spec", {}).get("claimRef")
    if not ref:
        return False
    md = claim.get("metadata", {})
    if ref.get("name") != md.get("name") or ref.get("namespace") != md.get("namespace"):
        return False
    return not ref.get("uid") or ref.get("uid") == md.get("uid")


def check_volume_satisfies_claim(volume: PersistentVolume, claim: PersistentVolumeClaim) -> str | None:
    """Why a volume the user asked for by name cannot serve the claim, or None when it can."""
    if is_deleting(volume):
        return f'the volume is marked for deletion "{volume["metadata"]["name"]}"'
    if volume_capacity(volume) < claim_request(claim):
        return "requested PV is too small"
    if volume_class(volume) != claim_class(claim):
        return "storageClassName does not match"
    if attributes_class_mismatch(claim, volume):
        return "volumeAttributesClassName does not match"
    if volume_mode_mismatch(claim, volume):
        return "incompatible volumeMode"
    if not contains_access_modes(
        volume.get("spec", {}).get("accessModes") or [], claim.get("spec", {}).get("accessModes") or []
    ):
        return "incompatible accessMode"
    return None


# -- the volume index --------------------------------------------------------------------------------


@dataclass
class _Entry:
    bucket: str | None  # access-mode key when the volume is free (no claimRef), else None
    capacity: int
    claim: str | None  # "ns/name" of the claimRef, if any


@dataclass
class VolumeIndex:
    """Volumes by access-mode set (only free ones: no claimRef), each bucket sorted by capacity, and
    volumes by the claim their claimRef names. Finding the smallest fit is a bisect plus a short
    scan instead of a pass over every volume."""

    _buckets: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    _by_claim: dict[str, set[str]] = field(default_factory=dict)
    _entries: dict[str, _Entry] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._entries)

    def upsert(self, volume: PersistentVolume) -> None:
        name = volume["metadata"]["name"]
        self.remove(name)
        spec = volume.get("spec", {})
        ref = claim_ref_key(volume)
        bucket = None if ref else access_modes_key(spec.get("accessModes") or [])
        entry = _Entry(bucket, volume_capacity(volume), ref)
        self._entries[name] = entry
        if bucket is not None:
            bisect.insort(self._buckets.setdefault(bucket, []), (entry.capacity, name))
        if ref is not None:
            self._by_claim.setdefault(ref, set()).add(name)

    def remove(self, name: str) -> None:
        entry = self._entries.pop(name, None)
        if entry is None:
            return
        if entry.bucket is not None:
            items = self._buckets[entry.bucket]
            i = bisect.bisect_left(items, (entry.capacity, name))
            if i < len(items) and items[i] == (entry.capacity, name):
                del items[i]
            if not items:
                del self._buckets[entry.bucket]
        if entry.claim is not None:
            names_ = self._by_claim.get(entry.claim)
            if names_ is not None:
                names_.discard(name)
                if not names_:
                    del self._by_claim[entry.claim]

    def bound_to(self, claim_key_: str) -> list[str]:
        """Names of volumes whose claimRef names this claim (any UID), sorted."""
        return sorted(self._by_claim.get(claim_key_, ()))

    def buckets_for(self, requested: Iterable[str], extra: Iterable[str] = ()) -> list[str]:
        """Access-mode keys of free volumes, plus `extra` keys, that offer every requested mode,
        fewest modes first (then by key, so the order is deterministic)."""
        want = set(requested)
        keys = {k for k in (*self._buckets, *extra) if want <= modes_of_key(k)}
        return sorted(keys, key=lambda k: (len(modes_of_key(k)), k))

    def free_at_least(self, bucket: str, size: int) -> Iterable[str]:
        """Free volume names in a bucket with capacity >= size, smallest first."""
        items = self._buckets.get(bucket, [])
        start = bisect.bisect_left(items, (size, ""))
        for i in range(start, len(items)):
            yield items[i][1]


def find_best_match(
    claim: PersistentVolumeClaim,
    index: VolumeIndex,
    get_volume: Callable[[str], PersistentVolume | None],
    delay_binding: bool,
    unusable: Callable[[str], bool] = lambda _: False,
) -> PersistentVolume | None:
    """The volume a claim without spec.volumeName should bind to, or None.

    kcm searches one access-mode set at a time, fewest modes first, and inside a set a volume
    already pointing at the claim (and fitting it) wins over the smallest Available one. So a free
    volume with exactly the requested modes beats a volume pre-bound to the claim that offers
    more modes. Unless binding is delayed to the scheduler, which still takes pre-bound volumes.
    `unusable(name)` excludes volumes another claim has reserved meanwhile.
    """
    spec = claim.get("spec", {})
    requested = spec.get("accessModes") or []
    size = claim_request(claim)

    pointing: dict[
        str, PersistentVolume
    ] = {}  # access-mode key -> first fitting volume pointing at the claim
    for name in index.bound_to(key_of(claim)):
        volume = get_volume(name)
        if volume is None or not is_bound_to_claim(volume, claim):
            continue
        if (
            volume_capacity(volume) >= size
            and not volume_mode_mismatch(claim, volume)
            and not attributes_class_mismatch(claim, volume)
            and not is_deleting(volume)
        ):
            pointing.setdefault(access_modes_key(volume.get("spec", {}).get("accessModes") or []), volume)

    for bucket in index.buckets_for(requested, pointing):
        if bucket in pointing:
            return pointing[bucket]
        if delay_binding:
            continue  # the scheduler picks free volumes together with the node
        for name in index.free_at_least(bucket, size):
            volume = get_volume(name)
            if volume is None or unusable(name):
                continue
            if free_volume_fits(volume, claim, check_size_and_modes=False):
                return volume
    return None


def free_volume_fits(
    volume: PersistentVolume, claim: PersistentVolumeClaim, check_size_and_modes: bool = True
) -> bool:
    """Whether a free (claimRef-less) volume may be bound to a claim that did not name it. The
    index already guarantees size and access modes when searching, so callers can skip those."""
    if volume.get("spec", {}).get("claimRef"):
        return False
    if check_size_and_modes and (
        volume_capacity(volume) < claim_request(claim)
        or not contains_access_modes(
            volume.get("spec", {}).get("accessModes") or [], claim.get("spec", {}).get("accessModes") or []
        )
    ):
        return False
    labels = volume.get("metadata", {}).get("labels") or {}
    return not (
        volume.get("status", {}).get("phase") != storage.PV_AVAILABLE
        or is_deleting(volume)
        or volume_mode_mismatch(claim, volume)
        or attributes_class_mismatch(claim, volume)
        or volume_class(volume) != claim_class(claim)
        or not selector_matches(claim.get("spec", {}).get("selector"), labels)
    )


def default_class(classes: Iterable[StorageClass]) -> StorageClass | None:
    """The default StorageClass; with several, the newest wins (then the name), as upstream."""
    defaults = [
        c
        for c in classes
        if (c.get("metadata", {}).get("annotations") or {}).get(storage.ANN_DEFAULT_CLASS) == "true"
        or (c.get("metadata", {}).get("annotations") or {}).get(storage.ANN_BETA_DEFAULT_CLASS) == "true"
    ]
    if not defaults:
        return None
    # max() keeps the first of equal keys: sorting by name first makes the smallest name win a tie.
    by_name = sorted(defaults, key=lambda c: str(c["metadata"]["name"]))
    return max(by_name, key=lambda c: str(c["metadata"].get("creationTimestamp", "")))
