"""The persistent-volume binder: kcm's persistentvolume-binder as its own asyncio controller.

Two queues (volumes by name, claims by namespace/name) feed idempotent syncs that read the local
view (see view.py), decide with the pure functions of decide.py and match.py, and write with the
resourceVersion they read. A bind is four ordered writes; whatever a crash or a conflict leaves
half done, the next sync of the claim or the volume completes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass

from controller_runtime import storage
from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, InformerController, run_workers
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import (
    PersistentVolume,
    PersistentVolumeClaim,
    StorageClass,
    as_obj,
    pv_view,
    pvc_view,
    storage_class_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.resources import (
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    STORAGE_CLASSES,
    Obj,
    key_of,
    object_key,
    reference_key,
    typed,
)
from controller_runtime.storage import claim_class, claim_has_class, volume_class
from controller_runtime.volumes import pod_claim_keys
from controller_runtime.workqueue import WorkQueue, default_rate_limiter

from . import names
from .decide import (
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
    has_annotation,
    is_delay_binding,
    phase_of,
    provisioning_error,
    unscheduled_pods,
    volume_bound_to_claim,
    volume_released,
    volume_unbound,
    volume_with_phase,
)
from .match import (
    check_volume_satisfies_claim,
    claim_ref_key,
    default_class,
    find_best_match,
    free_volume_fits,
    is_bound_to_claim,
)
from .metrics import METRICS, NOT_AVAILABLE, OperationTimer
from .view import LocalView

log = get_logger("pv-controller")

POD_CLAIMS_INDEX = "pvc"


class BindingError(Exception):
    """A binding that cannot be right as it stands; retried with backoff."""


@dataclass(frozen=True)
class Options:
    resync_period: float = 15.0
    workers: int = 8
    # New binds with their leading writes in flight at once (kcm: one, its single claim worker).
    # A bind is three round trips in sequence (see _bind), so by Little's law a bind takes
    # (binds in flight) / (binds per second): once the apiserver is busy, a second bind in flight
    # queues its writes behind the first's. One keeps each bind as short as kcm's; since a bind's
    # last write overlaps the next bind's first, one still binds faster than kcm (see
    # docs/pv-controller.md, Binds in flight).
    binds_in_flight: int = 1
    # Per-key retry backoff of both queues (client-go's defaults); resync re-adds every key anyway.
    retry_base: float = 0.005
    retry_max: float = 1000.0


def _cacheable(written: Obj) -> Obj:
    """A write's answer as the view keeps it: without managedFields, like the informers' copies.
    The next write of a bind is built from this answer; carrying managedFields back in that PUT
    would only make the apiserver decode and compare them again."""
    written.get("metadata", {}).pop("managedFields", None)
    return written


class _BindSlot:
    """One of the `binds_in_flight` slots: held from a new bind's first write until its last one
    leaves, so that last write (the claim's phase, which nothing of the bind waits for) overlaps
    the next bind's first."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots = slots
        self._held = False

    async def __aenter__(self) -> _BindSlot:
        await self._slots.acquire()
        self._held = True
        return self

    async def __aexit__(self, *_exc: object) -> None:
        self.release()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots.release()


class PVController(InformerController):
    def __init__(self, context: ControllerContext, options: Options | None = None) -> None:
        super().__init__(context)
        self.options = options or Options()
        self.timer = OperationTimer(self.clock)
        self.delete_backoff = OperationBackoff()
        self.volume_queue: WorkQueue[str] = WorkQueue(
            "volumes",
            default_rate_limiter(self.options.retry_base, self.options.retry_max, self.clock),
            clock=self.clock,
        )
        self.claim_queue: WorkQueue[str] = WorkQueue(
            "claims",
            default_rate_limiter(self.options.retry_base, self.options.retry_max, self.clock),
            clock=self.clock,
        )
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        self.view = LocalView(self.volumes.store, self.claims.store, self.clock)
        self.classes = self.factory.informer(STORAGE_CLASSES)
        self.pods = self.factory.informer(PODS)
        # Upstream takes a Node informer too; kubeloop waits for it so its start-up matches, and it
        # is where topology-aware decisions would read nodes from.
        self.nodes = self.factory.informer(NODES)
        self.pods.add_index(POD_CLAIMS_INDEX, pod_claim_keys)
        self.volumes.add_handler(EventHandler(self._volume_added, self._volume_updated, self._volume_deleted))
        self.claims.add_handler(EventHandler(self._claim_changed, self._claim_updated, self._claim_deleted))
        self.classes.add_handler(EventHandler(self._class_changed, self._class_updated, None))
        self._counts = (self.view.all_volumes, self.view.all_claims)
        self._throttled_writes = asyncio.Lock()
        self._bind_slots = asyncio.Semaphore(max(1, self.options.binds_in_flight))

    # -- event handlers: keep the view current and enqueue keys, nothing else -------------------------

    def _volume_added(self, volume: Obj) -> None:
        self._volume_updated(volume, volume)
        # A claim that names a volume which did not exist yet waits for it.
        for key in self.view.claims_naming(volume["metadata"]["name"]):
            self.claim_queue.add(key)

    def _volume_updated(self, _old: Obj, volume: Obj) -> None:
        self.view.volume_observed(volume["metadata"]["name"])
        self.volume_queue.add(volume["metadata"]["name"])

    def _volume_deleted(self, volume: Obj) -> None:
        name = volume["metadata"]["name"]
        self.view.delete_volume(volume)
        self.volume_queue.add(name)
        ref = claim_ref_key(pv_view(volume))
        if ref is not None:
            self.claim_queue.add(ref)
        for key in self.view.claims_naming(name):
            self.claim_queue.add(key)

    def _claim_changed(self, claim: Obj) -> None:
        self.view.claim_observed(key_of(claim))
        self.claim_queue.add(key_of(claim))

    def _claim_updated(self, _old: Obj, claim: Obj) -> None:
        self._claim_changed(claim)

    def _claim_deleted(self, claim: Obj) -> None:
        key = key_of(claim)
        self.view.delete_claim(claim)
        self.claim_queue.add(key)
        for name in self.view.index.bound_to(key):
            self.volume_queue.add(name)
        volume_name = claim.get("spec", {}).get("volumeName")
        if volume_name:
            self.volume_queue.add(volume_name)

    def _class_changed(self, _cls: Obj) -> None:
        # A new default class (retroactive assignment) or a class a claim was waiting for.
        for claim in self.view.all_claims():
            if not has_annotation(pvc_view(claim), storage.ANN_BIND_COMPLETED):
                self.claim_queue.add(key_of(claim))

    def _class_updated(self, old: Obj, new: Obj) -> None:
        if old is not new:  # a resync hands the same object: nothing changed
            self._class_changed(new)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Starts the informers, waits until every cache is filled, then runs the workers until
        cancelled."""
        METRICS.sources.append(self._counts)
        try:
            await self.start_informers()
            # Everything alive now (modules, the filled caches) stays alive: keep it out of the
            # cyclic collector's full passes, which would otherwise walk it all again and again
            # (~50 ms each on a small VM, stalling every in-flight bind).
            gc.freeze()
            log.info(
                "caches synced, starting workers",
                volumes=len(self.view.volumes),
                claims=len(self.view.claims),
                workers=self.options.workers,
            )
            volumes = asyncio.create_task(
                run_workers(self.volume_queue, self.sync_volume_key, self.options.workers)
            )
            try:
                # Volumes first: a fresh volume is Pending until its first sync, and claims synced
                # before that would find nothing and wait for a resync.
                with contextlib.suppress(TimeoutError):
                    await self.clock.wait_for(self.volume_queue.wait_idle(), self.options.resync_period)
                log.info("first pass over volumes done, starting claim workers")
                await run_workers(self.claim_queue, self.sync_claim_key, self.options.workers)
            finally:
                volumes.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await volumes
        finally:
            self.volume_queue.shutdown()
            self.claim_queue.shutdown()
            with contextlib.suppress(ValueError):
                METRICS.sources.remove(self._counts)
            await self.factory.stop()

    # -- writes: each stores its answer in the view so the next decision sees it ----------------------

    async def _update_volume(self, volume: Obj) -> PersistentVolume:
        new = _cacheable(await self.client.update(PERSISTENT_VOLUMES, volume))
        self.view.volume_written(new)
        return pv_view(new)

    async def _update_volume_status(self, volume: Obj) -> PersistentVolume:
        new = _cacheable(await self.client.update_status(PERSISTENT_VOLUMES, volume))
        self.view.volume_written(new)
        return pv_view(new)

    async def _update_claim(self, claim: Obj) -> PersistentVolumeClaim:
        new = _cacheable(await self.client.update(PERSISTENT_VOLUME_CLAIMS, claim))
        self.view.claim_written(new)
        return pvc_view(new)

    async def _update_claim_status(self, claim: Obj) -> PersistentVolumeClaim:
        new = _cacheable(await self.client.update_status(PERSISTENT_VOLUME_CLAIMS, claim))
        self.view.claim_written(new)
        return pvc_view(new)

    async def _set_volume_phase(
        self, volume: PersistentVolume, phase: str, event: tuple[str, str, str] | None = None
    ) -> PersistentVolume:
        """Sets the phase; `event` (type, reason, message) is emitted only when the phase changes,
        and its message becomes status.message."""
        new = volume_with_phase(volume, phase, event[2] if event else "")
        if new is None:
            return volume
        volume = await self._update_volume_status(new)
        if event is not None:
            self.recorder.record(typed(as_obj(volume), PERSISTENT_VOLUMES), *event)
        return volume

    async def _set_claim_phase(
        self, claim: PersistentVolumeClaim, phase: str, volume: PersistentVolume | None
    ) -> PersistentVolumeClaim:
        """Sets the phase, and the access modes and capacity that go with it."""
        new = claim_with_status(claim, phase, volume)
        if new is None:
            return claim
        return await self._update_claim_status(new)

    async def _mark_claim_lost(self, claim: PersistentVolumeClaim, reason: str, message: str) -> None:
        """Lost with a Warning event, once: a claim already Lost is not written again."""
        new = claim_lost(claim)
        if new is not None:
            claim = await self._update_claim_status(new)
            self._claim_event(claim, "Warning", reason, message)

    def _claim_event(self, claim: PersistentVolumeClaim, event_type: str, reason: str, message: str) -> None:
        self.recorder.record(typed(as_obj(claim), PERSISTENT_VOLUME_CLAIMS), event_type, reason, message)

    def _volume_event(self, volume: PersistentVolume, event_type: str, reason: str, message: str) -> None:
        self.recorder.record(typed(as_obj(volume), PERSISTENT_VOLUMES), event_type, reason, message)

    # -- volumes -------------------------------------------------------------------------------------

    async def sync_volume_key(self, name: str) -> float | None:
        volume = self.view.volume(name)
        if volume is None:
            # Deleted: an external delete we were waiting for has finished.
            self.timer.finish(name, "delete")
            self.delete_backoff.forget(name)
            return None
        if self.client.throttled:
            # Out of tokens, a volume's Available write would only queue in the bucket between the
            # writes of a bind in flight (with claim workers started before the first pass over
            # volumes is done, that made each bind wait for up to eight of them per write).
            async with self._throttled_writes:
                # It may have changed while we waited; if it was deleted, the delete handler has
                # queued it again and that sync ends its timer.
                current = self.view.volume(name)
                if current is not None:
                    await self.sync_volume(current)
            return None
        await self.sync_volume(volume)
        return None

    async def _fetch_claim(self, namespace: str, name: str) -> PersistentVolumeClaim | None:
        """The claim as the API has it now (None when it does not exist); the view learns it."""
        try:
            claim = await self.client.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
        if self.view.claim_written(claim):
            self.claim_queue.add(key_of(claim))
        return pvc_view(claim)

    async def _claim_of(self, volume: PersistentVolume) -> PersistentVolumeClaim | None:
        """The claim the volume's claimRef names, or None when it is really gone or has another
        UID. A miss in the view is confirmed with the API before anyone may act on it: the watch
        can lag (the claim may have been created a moment ago), and releasing a volume is not
        something to do on a stale cache."""
        ref = volume["spec"]["claimRef"]
        ns, name, uid = ref.get("namespace", ""), ref.get("name", ""), ref.get("uid")
        claim = self.view.claim(object_key(ns, name))
        if claim is None and phase_of(volume) not in (storage.PV_RELEASED, storage.PV_FAILED):
            claim = await self._fetch_claim(ns, name)
        if claim is not None and claim["metadata"].get("uid") != uid:
            # Our copy may be older than the claimRef (the claim was re-created): ask the API.
            claim = await self._fetch_claim(ns, name)
            if claim is not None and claim["metadata"].get("uid") != uid:
                claim = None
        return claim

    async def sync_volume(self, volume: PersistentVolume) -> None:
        ref = volume.get("spec", {}).get("claimRef")
        claim = await self._claim_of(volume) if ref and ref.get("uid") else None
        action = decide_volume(volume, claim)
        if action is VolumeAction.AVAILABLE:
            if phase_of(volume) != storage.PV_AVAILABLE:
                volume = await self._set_volume_phase(volume, storage.PV_AVAILABLE)
                woken = self.view.wake_one(lambda claim: free_volume_fits(volume, claim))
                if woken is not None:
                    self.claim_queue.add(woken)
        elif action is VolumeAction.PREBOUND:
            assert ref is not None  # decide_volume says PREBOUND only for a claimRef
            await self._set_volume_phase(volume, storage.PV_AVAILABLE)
            self.claim_queue.add(reference_key(ref))
        elif action in (VolumeAction.RELEASE, VolumeAction.RELEASE_PROVISIONED):
            if phase_of(volume) not in (storage.PV_RELEASED, storage.PV_FAILED):
                log.info(
                    "volume released, reclaiming",
                    volume=volume["metadata"]["name"],
                    policy=volume["spec"].get("persistentVolumeReclaimPolicy", ""),
                )
                volume = await self._set_volume_phase(volume, storage.PV_RELEASED)
            await self._reclaim(volume, claim)
        elif action is VolumeAction.MODE_MISMATCH:
            assert claim is not None
            pv_name, claim_name = volume["metadata"]["name"], claim["metadata"]["name"]
            self._volume_event(
                volume,
                "Warning",
                names.VOLUME_MISMATCH,
                "Cannot bind PersistentVolume to requested PersistentVolumeClaim "
                f'"{claim_name}" due to incompatible volumeMode.',
            )
            self._claim_event(
                claim,
                "Warning",
                names.VOLUME_MISMATCH,
                f'Cannot bind PersistentVolume "{pv_name}" to requested PersistentVolumeClaim '
                "due to incompatible volumeMode.",
            )
        elif action is VolumeAction.SYNC_CLAIM:
            assert claim is not None
            self.claim_queue.add(key_of(claim))
        elif action is VolumeAction.BOUND:
            # A bind in flight writes this phase itself, side by side with the claim's volumeName:
            # a second writer now would only make one of them conflict.
            if not self.view.reserved(volume["metadata"]["name"]):
                await self._set_volume_phase(volume, storage.PV_BOUND)
        elif action is VolumeAction.UNBIND:
            log.info(
                "claim is bound to another volume, unbinding",
                volume=volume["metadata"]["name"],
                by_controller=has_annotation(volume, storage.ANN_BOUND_BY_CONTROLLER),
            )
            volume = await self._update_volume(volume_unbound(volume))
            await self._set_volume_phase(volume, storage.PV_AVAILABLE)

    async def _reclaim(self, volume: PersistentVolume, claim: PersistentVolumeClaim | None) -> None:
        decision = decide_reclaim(volume)
        name = volume["metadata"]["name"]
        if decision.action is ReclaimAction.NONE:
            return
        if decision.action is ReclaimAction.EXTERNAL_DELETE:
            # The provisioner deletes it; the metric ends when the volume disappears. kcm labels it
            # with the provisioner of the volume's class, not the annotation (fewer label values).
            cls = self.classes.store.get(volume_class(volume))
            self.timer.start(
                name, "delete", str(cls.get("provisioner") or NOT_AVAILABLE) if cls else NOT_AVAILABLE
            )
            return
        if decision.action is ReclaimAction.FAILED_DELETE:
            # kcm starts the timer for every Delete reclaim; with no deleter its plugin is "N/A",
            # and each failed attempt counts an error.
            self.timer.start(name, "delete", NOT_AVAILABLE)
            now = self.clock.monotonic()
            if not volume_released(volume, claim) or not self.delete_backoff.ready(name, now):
                return
            self.delete_backoff.failed(name, now)
            self.timer.failed(name, "delete")
            event = ("Warning", storage.VOLUME_FAILED_DELETE, decision.message)
        elif decision.action is ReclaimAction.RECYCLE_UNSUPPORTED:
            event = ("Warning", names.VOLUME_FAILED_RECYCLE, decision.message)
        else:
            event = ("Warning", names.VOLUME_UNKNOWN_RECLAIM_POLICY, decision.message)
        await self._set_volume_phase(volume, storage.PV_FAILED, event)

    # -- claims --------------------------------------------------------------------------------------

    async def sync_claim_key(self, key: str) -> float | None:
        claim = self.view.claim(key)
        if claim is None:
            self.timer.drop(key, "provision")
            return None
        if has_annotation(claim, storage.ANN_BIND_COMPLETED):
            self.view.waiting.pop(key, None)
            await self._sync_bound_claim(claim)
            return None
        return await self._sync_unbound_claim(claim)

    async def _sync_bound_claim(self, claim: PersistentVolumeClaim) -> None:
        volume_name = claim.get("spec", {}).get("volumeName") or ""
        volume = self.view.volume(volume_name) if volume_name else None
        if volume is None and volume_name:
            # Lost is final: make sure the volume is really gone, not just late in the watch.
            try:
                fetched = await self.client.get(PERSISTENT_VOLUMES, volume_name)
                self.view.volume_written(fetched)
                volume = pv_view(fetched)
            except ApiError as exc:
                if not exc.not_found:
                    raise
        action = decide_bound_claim(claim, volume)
        if action is BoundClaimAction.LOST_REFERENCE:
            await self._mark_claim_lost(claim, names.CLAIM_LOST_REASON, names.MSG_CLAIM_LOST_REFERENCE)
        elif action is BoundClaimAction.LOST_VOLUME:
            await self._mark_claim_lost(claim, names.CLAIM_LOST_REASON, names.MSG_CLAIM_LOST_VOLUME)
        elif action is BoundClaimAction.MISBOUND:
            await self._mark_claim_lost(claim, names.CLAIM_MISBOUND, names.MSG_CLAIM_MISBOUND)
        else:
            assert volume is not None
            await self._bind(volume, claim)

    async def _sync_unbound_claim(self, claim: PersistentVolumeClaim) -> float | None:
        key = key_of(claim)
        volume_name = claim.get("spec", {}).get("volumeName") or ""
        if volume_name:
            return await self._sync_prebound_claim(claim, volume_name)
        class_name = claim_class(claim)
        storage_class = storage_class_view(self.classes.store.get(class_name)) if class_name else None
        delay = is_delay_binding(class_name, storage_class)  # raises for a class without a mode
        # No await between the search and the reservation: concurrent workers cannot both take it.
        volume = find_best_match(
            claim,
            self.view.index,
            self.view.volume,
            delay,
            lambda name: self.view.reserved_by_other(name, key),
        )
        if volume is not None:
            self.view.waiting.pop(key, None)
            await self._bind_reserved(volume, claim)
            return None
        if not delay:
            self.view.waiting[key] = None
        if await self._assign_default_class(claim):
            return None
        annotations = claim.get("metadata", {}).get("annotations") or {}
        if delay and storage.ANN_SELECTED_NODE not in annotations:
            self._event_waiting_for_consumer(claim)
        elif class_name:
            await self._provision(claim, class_name, storage_class)
            return None
        else:
            self._claim_event(claim, "Normal", names.FAILED_BINDING, names.MSG_NO_CLASS)
        await self._set_claim_phase(claim, storage.CLAIM_PENDING, None)
        return None

    async def _sync_prebound_claim(self, claim: PersistentVolumeClaim, volume_name: str) -> float | None:
        """The user named the volume in spec.volumeName."""
        key = key_of(claim)
        volume = self.view.volume(volume_name)
        if volume is None:
            # Not there (yet): the claim waits; the volume's arrival enqueues it.
            await self._set_claim_phase(claim, storage.CLAIM_PENDING, None)
            return None
        if not volume.get("spec", {}).get("claimRef"):
            if self.view.reserved_by_other(volume_name, key):
                return 0.05  # another claim is binding it right now; look again when it is done
            problem = check_volume_satisfies_claim(volume, claim)
            if problem is not None:
                self._claim_event(
                    claim,
                    "Warning",
                    names.VOLUME_MISMATCH,
                    f'Cannot bind to requested volume "{volume_name}": {problem}',
                )
                await self._set_claim_phase(claim, storage.CLAIM_PENDING, None)
                return None
            await self._bind_reserved(volume, claim)
            return None
        if is_bound_to_claim(volume, claim):
            await self._bind(volume, claim)
            return None
        self._claim_event(
            claim,
            "Warning",
            names.FAILED_BINDING,
            f'volume "{volume_name}" already bound to a different claim.',
        )
        if not has_annotation(claim, storage.ANN_BOUND_BY_CONTROLLER):
            await self._set_claim_phase(claim, storage.CLAIM_PENDING, None)
            return None
        raise BindingError(
            f"invalid binding of claim {key} to volume {volume_name}: "
            f"volume already claimed by {claim_ref_key(volume)}"
        )

    async def _bind_reserved(self, volume: PersistentVolume, claim: PersistentVolumeClaim) -> None:
        name, key = volume["metadata"]["name"], key_of(claim)
        if not self.view.reserve(name, key):
            raise BindingError(f"volume {name} is reserved by another claim")
        try:
            if self.client.throttled:
                # The client-side limiter is the bottleneck: a second bind in flight would bind
                # no faster, only interleave its writes with this one's in the token bucket and
                # make both slower. While throttled, new binds (and volume syncs, see
                # sync_volume_key) go one at a time whatever binds_in_flight allows.
                async with self._throttled_writes, self._bind_slots:
                    await self._bind(volume, claim)
            else:
                async with _BindSlot(self._bind_slots) as slot:
                    await self._bind(volume, claim, slot.release)
        except Exception:
            # A provision's bind that fails counts as a failed provision (the timer keeps running).
            self.timer.failed(key, "provision")
            raise
        finally:
            self.view.release(name, key)

    async def _bind(
        self,
        volume: PersistentVolume,
        claim: PersistentVolumeClaim,
        before_last_write: Callable[[], None] | None = None,
    ) -> None:
        """kcm's four writes; each is skipped when already done, so a bind cut short at any point
        is finished by the next sync of either object. The volume's claimRef goes first (it
        reserves the volume for the claim) and the claim's phase last, once both middle writes
        succeeded, so a claim is never Bound before its volume. The two middle writes (volume
        phase, claim volumeName) touch different objects and neither reads the other's answer:
        they go together, three round trips in sequence instead of four. `before_last_write` gives
        the bind's slot back before the claim's phase is written."""
        new = volume_bound_to_claim(volume, claim)
        if new is not None:
            volume = await self._update_volume(new)
        phase = volume_with_phase(volume, storage.PV_BOUND)
        spec = claim_bound_to_volume(claim, volume)
        if phase is not None and spec is not None:
            volume, claim = await self._update_both(phase, spec)
        elif phase is not None:
            volume = await self._update_volume_status(phase)
        elif spec is not None:
            claim = await self._update_claim(spec)
        if before_last_write is not None:
            before_last_write()
        await self._set_claim_phase(claim, storage.CLAIM_BOUND, volume)
        self.timer.finish(key_of(claim), "provision")

    async def _update_both(self, phase: Obj, spec: Obj) -> tuple[PersistentVolume, PersistentVolumeClaim]:
        """The volume's phase and the claim's spec written at once. Both are awaited to the end
        before an error is raised: the reservation must outlive every write of the bind."""
        new_volume, new_claim = await asyncio.gather(
            self._update_volume_status(phase), self._update_claim(spec), return_exceptions=True
        )
        if isinstance(new_volume, BaseException):
            if isinstance(new_claim, BaseException):
                log.warning("claim write failed too", claim=key_of(spec), error=str(new_claim))
            raise new_volume
        if isinstance(new_claim, BaseException):
            raise new_claim
        return new_volume, new_claim

    async def _assign_default_class(self, claim: PersistentVolumeClaim) -> bool:
        """Gives a claim with no class (nil, not "") the default StorageClass once one exists."""
        if claim_has_class(claim):
            return False
        cls = default_class(storage_class_view(c) for c in self.classes.store.values())
        if cls is None:
            return False
        new: Obj = {**claim, "spec": {**claim["spec"], "storageClassName": cls["metadata"]["name"]}}
        try:
            await self._update_claim(new)
        except Exception:
            METRICS.retroactive_assignment(success=False)
            raise
        METRICS.retroactive_assignment(success=True)
        log.info("assigned the default storage class", claim=key_of(claim), cls=cls["metadata"]["name"])
        return True

    def _event_waiting_for_consumer(self, claim: PersistentVolumeClaim) -> None:
        pods = unscheduled_pods(self.pods.store.by_index(POD_CLAIMS_INDEX, key_of(claim)))
        if pods:
            self._claim_event(
                claim, "Normal", names.WAIT_FOR_POD_SCHEDULED, names.msg_wait_pods_scheduled(pods)
            )
        else:
            self._claim_event(claim, "Normal", names.WAIT_FOR_FIRST_CONSUMER, names.MSG_WAIT_FIRST_CONSUMER)

    async def _provision(
        self, claim: PersistentVolumeClaim, class_name: str, storage_class: StorageClass | None
    ) -> None:
        problem = provisioning_error(class_name, storage_class)
        if problem is not None:
            self._claim_event(claim, "Warning", storage.PROVISIONING_FAILED, problem)
            return
        assert storage_class is not None
        provisioner = str(storage_class["provisioner"])
        self.timer.start(key_of(claim), "provision", provisioner)
        new = claim_with_provisioner(claim, provisioner)
        if new is not None:
            try:
                claim = await self._update_claim(new)
            except ApiError as exc:
                self._claim_event(claim, "Warning", storage.PROVISIONING_FAILED, f"Error saving claim: {exc}")
                self.timer.failed(key_of(claim), "provision")
                raise
        self._claim_event(
            claim, "Normal", names.EXTERNAL_PROVISIONING, names.msg_external_provisioning(provisioner)
        )
