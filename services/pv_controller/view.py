"""The binder's own view of volumes and claims.

It reads the informers' caches through a MutationCache (controller_runtime.mutation_cache, with
`include_adds`) that overlays the answers to our own writes and reads: the view never goes back
in time, so a worker that just bound a volume does not see it free again because the watch is a
little behind, and a claim fetched from the API before the watch delivered it is seen at once
(kcm's pv-controller keeps its own volume and claim caches for the same reasons). Reservations make
"find a free volume and claim it" atomic across concurrent workers: the search skips volumes
another claim reserved, and the search plus the reservation run without an await in between.
"""

from __future__ import annotations

from collections.abc import Callable

from controller_runtime.clock import SYSTEM_CLOCK, PassiveClock
from controller_runtime.kinds import PersistentVolume, PersistentVolumeClaim, pv_view, pvc_view
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import Obj, key_of, revision_of
from controller_runtime.store import Store

from .match import VolumeIndex


class LocalView:
    def __init__(
        self, volumes: Store | None = None, claims: Store | None = None, clock: PassiveClock = SYSTEM_CLOCK
    ) -> None:
        """`volumes` and `claims` are the informers' stores (read only here); without them the
        view stands alone (tests of the deciding code)."""
        # `is None`, not `or`: an informer's store is empty (falsy) until its cache fills.
        self.volumes = MutationCache(Store() if volumes is None else volumes, include_adds=True, clock=clock)
        self.claims = MutationCache(Store() if claims is None else claims, include_adds=True, clock=clock)
        self.index = VolumeIndex()
        self._indexed: dict[str, Obj] = {}  # volume name -> the version the index holds
        self._claims_by_volume: dict[str, set[str]] = {}
        self._claim_volume: dict[str, str] = {}  # claim key -> the volumeName indexed for it
        self._reserved: dict[str, str] = {}  # volume name -> claim key
        # Claims that found no volume, oldest first: a volume that becomes Available wakes one
        # that it fits instead of leaving it to the next resync.
        self.waiting: dict[str, None] = {}

    # -- volumes ------------------------------------------------------------------------------------

    def volume(self, name: str) -> PersistentVolume | None:
        return pv_view(self.volumes.get(name))

    def volume_observed(self, name: str) -> None:
        """The informer's cache changed the volume: the index follows the freshest version."""
        volume = self.volumes.get(name)
        if volume is None:
            self._indexed.pop(name, None)
            self.index.remove(name)
        elif self._indexed.get(name) is not volume:  # a resync hands back the same object
            self._indexed[name] = volume
            self.index.upsert(pv_view(volume))

    def volume_written(self, volume: Obj) -> bool:
        """An answer from the API (our write, or a read): True when the view now holds that version
        (it was not older than what the view holds, nor than its deletion)."""
        name = volume["metadata"]["name"]
        self.volumes.mutated(volume)
        self.volume_observed(name)
        held = self.volumes.get(name)
        return held is not None and revision_of(held) == revision_of(volume)

    def delete_volume(self, volume: Obj) -> None:
        name = volume["metadata"]["name"]
        self.volumes.deleted(volume)
        self._indexed.pop(name, None)
        self.index.remove(name)
        self._reserved.pop(name, None)

    # -- claims -------------------------------------------------------------------------------------

    def claim(self, key: str) -> PersistentVolumeClaim | None:
        return pvc_view(self.claims.get(key))

    def claim_observed(self, key: str) -> None:
        """The informer's cache changed the claim: the by-volume index follows the freshest version."""
        claim = self.claims.get(key)
        volume_name = (claim or {}).get("spec", {}).get("volumeName") or ""
        if self._claim_volume.get(key, "") == volume_name:
            return
        self._unindex_claim(key)
        if volume_name:
            self._claim_volume[key] = volume_name
            self._claims_by_volume.setdefault(volume_name, set()).add(key)

    def claim_written(self, claim: Obj) -> bool:
        """As volume_written, for a claim."""
        key = key_of(claim)
        self.claims.mutated(claim)
        self.claim_observed(key)
        held = self.claims.get(key)
        return held is not None and revision_of(held) == revision_of(claim)

    def delete_claim(self, claim: Obj) -> None:
        key = key_of(claim)
        self.waiting.pop(key, None)
        self.claims.deleted(claim)
        self._unindex_claim(key)

    def _unindex_claim(self, key: str) -> None:
        old_volume = self._claim_volume.pop(key, "")
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
        return list(self.claims.values())

    def all_volumes(self) -> list[Obj]:
        return list(self.volumes.values())

    def wake_one(self, fits: Callable[[PersistentVolumeClaim], bool], limit: int = 64) -> str | None:
        """Takes the oldest waiting claim that `fits` (looking at no more than `limit` of them, so
        a volume no one wants costs little) out of the waiting set and returns its key."""
        for n, key in enumerate(list(self.waiting)):
            if n >= limit:
                break
            claim = self.claims.get(key)
            if claim is None:
                del self.waiting[key]
            elif fits(pvc_view(claim)):
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
