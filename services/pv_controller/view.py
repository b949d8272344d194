"""The binder's own view of volumes and claims.

It is fed by the informers and by the answers to our own writes, and never goes back in time: an
object older (by resourceVersion) than the one held is ignored, so a worker that just bound a
volume does not see it free again because the watch is a little behind. Reservations make "find a
free volume and claim it" atomic across concurrent workers: the search skips volumes another claim
reserved, and the search plus the reservation run without an await in between.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from controller_runtime.resources import Obj, key_of, newer, revision_of

from .match import VolumeIndex


@dataclass
class VersionedStore:
    """Objects by key; keeps a deleted object's resourceVersion for a while so a late write answer
    cannot resurrect it."""

    tombstone_capacity: int = 10_000
    items: dict[str, Obj] = field(default_factory=dict)
    _tombstones: OrderedDict[str, int] = field(default_factory=OrderedDict)

    def get(self, key: str) -> Obj | None:
        return self.items.get(key)

    def update(self, key: str, obj: Obj) -> Obj | None:
        """Stores obj unless it is older than what is held (or than its deletion); returns obj when
        stored, None when ignored."""
        held = self.items.get(key)
        dead = self._tombstones.get(key)
        if dead is not None and revision_of(obj) <= dead:
            return None
        if not newer(obj, held):
            return None
        self._tombstones.pop(key, None)
        self.items[key] = obj
        return obj

    def delete(self, key: str, obj: Obj | None) -> Obj | None:
        held = self.items.pop(key, None)
        rv = revision_of(obj) if obj is not None else 0
        if held is not None:
            rv = max(rv, revision_of(held))
        self._tombstones[key] = rv
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self.tombstone_capacity:
            self._tombstones.popitem(last=False)
        return held


class LocalView:
    def __init__(self) -> None:
        self.volumes = VersionedStore()
        self.claims = VersionedStore()
        self.index = VolumeIndex()
        self._claims_by_volume: dict[str, set[str]] = {}
        self._reserved: dict[str, str] = {}  # volume name -> claim key
        # Claims that found no volume, oldest first: a volume that becomes Available wakes one
        # that it fits instead of leaving it to the next resync.
        self.waiting: dict[str, None] = {}

    # -- volumes ------------------------------------------------------------------------------------

    def volume(self, name: str) -> Obj | None:
        return self.volumes.get(name)

    def store_volume(self, volume: Obj) -> bool:
        """True when the view took it (it was not older than what we hold)."""
        name = volume["metadata"]["name"]
        if self.volumes.items.get(name) is volume:
            return True  # a resync hands back the object we hold: nothing to re-index
        if self.volumes.update(name, volume) is None:
            return False
        self.index.upsert(volume)
        return True

    def delete_volume(self, volume: Obj) -> None:
        name = volume["metadata"]["name"]
        self.volumes.delete(name, volume)
        self.index.remove(name)
        self._reserved.pop(name, None)

    # -- claims -------------------------------------------------------------------------------------

    def claim(self, key: str) -> Obj | None:
        return self.claims.get(key)

    def store_claim(self, claim: Obj) -> bool:
        key = key_of(claim)
        old = self.claims.get(key)
        if old is claim:
            return True  # a resync hands back the object we hold: nothing to re-index
        if self.claims.update(key, claim) is None:
            return False
        self._unindex_claim(key, old)
        volume_name = claim.get("spec", {}).get("volumeName")
        if volume_name:
            self._claims_by_volume.setdefault(volume_name, set()).add(key)
        return True

    def delete_claim(self, claim: Obj) -> None:
        key = key_of(claim)
        self.waiting.pop(key, None)
        self._unindex_claim(key, self.claims.delete(key, claim))

    def _unindex_claim(self, key: str, old: Obj | None) -> None:
        old_volume = (old or {}).get("spec", {}).get("volumeName")
        if old_volume:
            keys = self._claims_by_volume.get(old_volume)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._claims_by_volume[old_volume]

    def claims_naming(self, volume_name: str) -> list[str]:
        """Keys of claims whose spec.volumeName is this volume."""
        return sorted(self._claims_by_volume.get(volume_name, ()))

    def all_claims(self) -> list[Obj]:
        return list(self.claims.items.values())

    def all_volumes(self) -> list[Obj]:
        return list(self.volumes.items.values())

    def wake_one(self, fits: Callable[[Obj], bool], limit: int = 64) -> str | None:
        """Takes the oldest waiting claim that `fits` (looking at no more than `limit` of them, so
        a volume no one wants costs little) out of the waiting set and returns its key."""
        for n, key in enumerate(list(self.waiting)):
            if n >= limit:
                break
            claim = self.claims.get(key)
            if claim is None:
                del self.waiting[key]
            elif fits(claim):
                del self.waiting[key]
                return key
        return None

    # -- reservations --------------------------------------------------------------------------------

    def reserve(self, volume_name: str, claim_key_: str) -> bool:
        holder = self._reserved.get(volume_name)
        if holder is not None and holder != claim_key_:
            return False
        self._reserved[volume_name] = claim_key_
        return True

    def reserved(self, volume_name: str) -> bool:
        return volume_name in self._reserved

    def reserved_by_other(self, volume_name: str, claim_key_: str) -> bool:
        holder = self._reserved.get(volume_name)
        return holder is not None and holder != claim_key_

    def release(self, volume_name: str, claim_key_: str) -> None:
        if self._reserved.get(volume_name) == claim_key_:
            del self._reserved[volume_name]
