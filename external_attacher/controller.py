"""The external-attacher's controller: VolumeAttachments of one driver, one idempotent sync each,
as csi-attacher's csiHandler (or, for a driver without PUBLISH_UNPUBLISH_VOLUME, its trivial
handler: status.attached and nothing else, no finalizers at all).

Attach: the PV's finalizer first, then the VA's finalizer and node-id annotation (so neither
object can vanish while the driver may have published the volume, and a detach still knows the
node id once the CSINode is gone), then ControllerPublishVolume (with the Secret the PV's
controllerPublishSecretRef names, and the one access mode csi-lib-utils maps the PV's list to),
then status.attached with the publish context. Detach (VA being deleted):
ControllerUnpublishVolume, whatever error it returns being retried, then the VA finalizer goes
and the status says detached; the PV finalizer goes only when the PV itself is being deleted and
no VolumeAttachment names it. Failures are written to attachError / detachError and retried with
per-key exponential backoff. A periodic pass
compares ListVolumes' published nodes with every VA of the driver and re-syncs each one whose
status.attached disagrees, either way, even if its status says nothing is left to do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, replace

import grpc

from controller_runtime.client import ApiError
from controller_runtime.clock import now_rfc3339
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController, SidecarOptions, error_text
from controller_runtime.csi_errors import PUBLISH_VOLUME, classify
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import (
    KubeObject,
    PersistentVolume,
    VolumeAttachment,
    pv_view,
    volume_attachment_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import (
    CSI_NODES,
    PERSISTENT_VOLUMES,
    SECRETS,
    VOLUME_ATTACHMENTS,
    Obj,
    Resource,
)
from controller_runtime.secrets import SecretNotSendable, csi_secrets
from controller_runtime.volumes import CSIVolume, attacher_finalizer, csi_volume, pv_capability
from controller_runtime.workqueue import (
    BucketRateLimiter,
    ItemExponentialRateLimiter,
    MaxOfRateLimiter,
    WorkQueue,
)
from kubeloop_grpc.csi import csi_pb2

log = get_logger("external-attacher")

ControllerRPC = csi_pb2.ControllerServiceCapability.RPC
VA_BY_PV = "pv"
# Where the attach records the node id, for a detach after the node's CSINode is gone.
ANN_VA_NODE_ID = "csi.alpha.kubernetes.io/node-id"
# Tries at adding the PV finalizer when other writers keep winning the race (409).
PV_FINALIZER_TRIES = 5


@dataclass(frozen=True)
class Options(SidecarOptions):
    timeout: float = 15.0
    reconcile_sync: float = 60.0
    # --default-fstype: the fsType passed to ControllerPublishVolume for a filesystem PV naming none.
    default_fstype: str = ""
    # The MutableCSINodeAllocatableCount gate (on by default, GA): a failed ControllerPublishVolume's
    # attachError carries its gRPC code as errorCode, which kubelet reads (ResourceExhausted).
    error_code: bool = True
    pv_workers: int = 4


class AttachError(Exception):
    """An attach or detach that failed; its text goes to the VA's attachError or detachError, and
    the gRPC code of a failed call (`code`) to attachError's errorCode."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


def call_failed(method: str, va: str, exc: grpc.aio.AioRpcError) -> AttachError:
    """A failed ControllerPublishVolume or ControllerUnpublishVolume, classified where it returned
    (csi_errors; external-attacher's isFinalError). Both are retried alike whatever it says, as
    csi-attacher retries them (it ignores the verdict too: a VA that goes is detached whatever its
    attach left behind), so the state is for the operator: a call that may still be running in
    the driver is no refusal."""
    state = classify(PUBLISH_VOLUME, exc.code())
    log.info(f"{method} failed", va=va, state=state.value, error=error_text(exc))
    return AttachError(error_text(exc), code=exc.code().value[0])


def va_pv_name(va: VolumeAttachment) -> str:
    return str(va.get("spec", {}).get("source", {}).get("persistentVolumeName") or "")


class Attacher(SidecarController):
    def __init__(
        self, context: ControllerContext, csi: CSIConnection, options: Options | None = None
    ) -> None:
        super().__init__(context, csi)
        self.finalizer = attacher_finalizer(self.driver)
        self.options = options or Options()
        self.can_publish = csi.has_controller_capability(ControllerRPC.PUBLISH_UNPUBLISH_VOLUME)
        self.can_list = csi.has_controller_capability(
            ControllerRPC.LIST_VOLUMES
        ) and csi.has_controller_capability(ControllerRPC.LIST_VOLUMES_PUBLISHED_NODES)
        self.single_node_multi_writer = csi.has_controller_capability(ControllerRPC.SINGLE_NODE_MULTI_WRITER)
        # "CO MUST set readonly to false if SP does not have PUBLISH_READONLY" (CSI spec).
        self.can_publish_readonly = csi.has_controller_capability(ControllerRPC.PUBLISH_READONLY)
        # VAs the ListVolumes pass found out of step: their next sync runs even if nothing seems due.
        self._force_sync: set[str] = set()
        self.vas = self.factory.informer(VOLUME_ATTACHMENTS)
        # VAs as our own last write returned them, until the cache holds that version or a newer
        # one. The finalizer write's event queues the VA again while its attach is still running;
        # synced from a cache that has not seen the status write yet, the VA looked unattached and
        # was attached a second time (ControllerPublishVolume and the status patch again: most
        # VAs of a 20-pod burst, measured).
        self.va_view = MutationCache(self.vas.store, clock=self.clock)
        limiter: MaxOfRateLimiter[str] = MaxOfRateLimiter(
            ItemExponentialRateLimiter(self.options.retry_start, self.options.retry_max),
            BucketRateLimiter(100.0, 1000, self.clock),
        )
        self.va_queue: WorkQueue[str] = WorkQueue("volumeattachments", limiter, clock=self.clock)
        self.pv_queue: WorkQueue[str] = WorkQueue(
            "persistentvolumes",
            MaxOfRateLimiter(
                ItemExponentialRateLimiter(self.options.retry_start, self.options.retry_max),
                BucketRateLimiter(100.0, 1000, self.clock),
            ),
            clock=self.clock,
        )
        self.pvs = self.factory.informer(PERSISTENT_VOLUMES)
        self.csinodes = self.factory.informer(CSI_NODES)
        self.vas.add_index(VA_BY_PV, lambda va: [n] if (n := va_pv_name(volume_attachment_view(va))) else [])
        self.vas.add_handler(EventHandler(self._va_changed, lambda _o, n: self._va_changed(n), self._va_gone))
        # The VolumeAttachment list that PV checks begun before it started may share.
        self._va_list: tuple[float, asyncio.Task[list[Obj]]] | None = None
        self.pvs.add_handler(EventHandler(self._pv_changed, lambda _o, n: self._pv_changed(n), None))

    # -- handlers: enqueue only -------------------------------------------------------------------

    def _ours(self, va: VolumeAttachment) -> bool:
        return bool(va.get("spec", {}).get("attacher") == self.driver)

    def _va_changed(self, va: Obj) -> None:
        if self._ours(volume_attachment_view(va)):
            self.va_queue.add(va["metadata"]["name"])

    def _va_gone(self, va: Obj) -> None:
        self.va_view.deleted(va)
        if pv := va_pv_name(volume_attachment_view(va)):
            self.pv_queue.add(pv)

    def _pv_changed(self, obj: Obj) -> None:
        md = pv_view(obj).get("metadata", {})
        if self.finalizer in (md.get("finalizers") or []) and md.get("deletionTimestamp"):
            self.pv_queue.add(md["name"])

    async def run(self) -> None:
        await self.start_informers()
        log.info("caches synced, starting workers", driver=self.driver, workers=self.options.workers)
        tasks = [
            asyncio.create_task(run_workers(self.va_queue, self.sync_va, self.options.workers)),
            asyncio.create_task(run_workers(self.pv_queue, self.sync_pv, self.options.pv_workers)),
        ]
        if self.can_publish and self.can_list and self.options.reconcile_sync > 0:
            tasks.append(asyncio.create_task(self._reconcile_loop()))
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.factory.stop()

    # -- VolumeAttachment sync --------------------------------------------------------------------

    async def sync_va(self, name: str) -> float | None:
        va = volume_attachment_view(self.va_view.get(name))
        if va is None or not self._ours(va):
            return None
        if not self.can_publish:
            # csi-attacher's trivial handler: nothing to publish, so no finalizer to hold the VA
            # (or the PV) back; it marks every VA of the driver attached, nothing more.
            if not va.get("status", {}).get("attached"):
                await self._mark_attached(va, {})
            return None
        forced = name in self._force_sync
        self._force_sync.discard(name)
        if va["metadata"].get("deletionTimestamp"):
            if forced or self.finalizer in (va["metadata"].get("finalizers") or []):
                await self._guarded(va, "detachError", self._detach(va))
            return None
        if forced or not va.get("status", {}).get("attached"):
            await self._guarded(va, "attachError", self._attach(va))
        return None

    async def _guarded(self, va: VolumeAttachment, error_field: str, work: Awaitable[None]) -> None:
        """Runs an attach or detach; its failure is written to the VA's status and raised again, so
        the queue retries with backoff."""
        try:
            await work
        except AttachError as exc:
            code = exc.code if error_field == "attachError" and self.options.error_code else None
            await self._set_error(va, error_field, str(exc), code)
            raise

    def _node_id_from_csinode(self, node: str) -> str:
        """The driver's node id from the node's CSINode; AttachError, with csi-attacher's words, when
        there is none."""
        csinode = self.csinodes.store.get(node)
        if csinode is None:
            raise AttachError(f'csinode.storage.k8s.io "{node}" not found')
        for drv in csinode.get("spec", {}).get("drivers") or []:
            if drv.get("name") == self.driver and drv.get("nodeID"):
                return str(drv["nodeID"])
        raise AttachError(f"CSINode {node} does not contain driver {self.driver}")

    def _node_id(self, va: VolumeAttachment) -> str:
        """For a detach or the ListVolumes pass: the CSINode's node id, else the one the attach
        recorded on the VA (the node and its CSINode may be gone by now)."""
        try:
            return self._node_id_from_csinode(va["spec"]["nodeName"])
        except AttachError:
            recorded = (va["metadata"].get("annotations") or {}).get(ANN_VA_NODE_ID)
            if recorded is None:
                raise
            return str(recorded)

    def _pv_of(self, va: VolumeAttachment) -> PersistentVolume:
        if va["spec"].get("source", {}).get("inlineVolumeSpec"):
            raise AttachError("inline volumes are not supported")
        pv_name = va_pv_name(va)
        pv = pv_view(self.pvs.store.get(pv_name))
        if pv is None:
            raise AttachError(f'persistentvolume "{pv_name}" not found')
        return pv

    @staticmethod
    def _csi_source(pv: PersistentVolume) -> CSIVolume:
        vol = csi_volume(pv)
        if vol is None:
            raise AttachError("pv spec contained non-csi source that was not migrated")
        return vol

    async def _attach(self, va: VolumeAttachment) -> None:
        name = va["metadata"]["name"]
        pv = self._pv_of(va)
        if pv["metadata"].get("deletionTimestamp"):
            raise AttachError(f'PersistentVolume "{pv["metadata"]["name"]}" is marked for deletion')
        node = va["spec"]["nodeName"]
        try:
            # csi-attacher's order: the source, the capability, the Secret, the node id.
            vol = self._csi_source(pv)
            if not vol.fs_type and not vol.block and self.options.default_fstype:
                vol = replace(vol, fs_type=self.options.default_fstype)
            try:
                capability = pv_capability(vol, self.single_node_multi_writer)
            except ValueError as exc:
                raise AttachError(str(exc)) from exc
            secret = await self._publish_secret(pv)
            node_id = self._node_id_from_csinode(node)
        except AttachError:
            # csi-attacher has added the PV finalizer before it finds out, but not the VA's.
            await self._ensure_pv_finalizer(pv)
            raise
        # Both finalizers before the driver is asked, written side by side (two requests, one
        # round trip of latency).
        va_result, pv_result = await asyncio.gather(
            self._ensure_va_finalizer(va, node_id), self._ensure_pv_finalizer(pv), return_exceptions=True
        )
        for result in (pv_result, va_result):
            if isinstance(result, BaseException):
                raise result
        assert not isinstance(va_result, BaseException)  # raised above
        req = csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.handle,
            node_id=node_id,
            volume_capability=capability,
            readonly=vol.read_only and self.can_publish_readonly,
            secrets=self._sendable(secret),
            volume_context=vol.attributes,
        )
        try:
            resp = await self.csi.controller.ControllerPublishVolume(req, timeout=self.options.timeout)
        except grpc.aio.AioRpcError as exc:
            raise call_failed("ControllerPublishVolume", name, exc) from exc
        await self._mark_attached(va_result, dict(resp.publish_context))
        log.info("attached", va=name, pv=pv["metadata"]["name"], node=node)

    async def _mark_attached(self, va: VolumeAttachment, context: dict[str, str]) -> None:
        status = {"attached": True, "attachmentMetadata": context or None, "attachError": None}
        name = va["metadata"]["name"]
        self.va_view.mutated(
            await self.client.patch(VOLUME_ATTACHMENTS, name, {"status": status}, subresource="status")
        )

    async def _publish_secret(self, pv: PersistentVolume) -> Obj | None:
        """The Secret the PV's controllerPublishSecretRef names, None without one. As csi-attacher,
        one that cannot be read fails the attach or detach (the driver may need it to act); the
        attacher's RBAC, like upstream's default, does not let it read Secrets, so a PV naming
        one is attached only where an admin granted `get`."""
        ref = ((pv.get("spec") or {}).get("csi") or {}).get("controllerPublishSecretRef")
        if not ref:
            return None
        name, namespace = str(ref.get("name") or ""), str(ref.get("namespace") or "")
        try:
            return await self.client.get(SECRETS, name, namespace)
        except ApiError as exc:
            raise AttachError(f'failed to load secret "{namespace}/{name}": {exc.message}') from exc

    @staticmethod
    def _sendable(secret: Obj | None) -> dict[str, str]:
        """The Secret's data for the request. Data that is not UTF-8 fails where the Go sidecar's
        request fails to marshal: after the finalizers, with grpc-go's words."""
        try:
            return csi_secrets(secret) if secret is not None else {}
        except SecretNotSendable as exc:
            raise AttachError(str(exc)) from exc

    async def _detach(self, va: VolumeAttachment) -> None:
        name = va["metadata"]["name"]
        pv = self._pv_of(va)
        vol = self._csi_source(pv)
        secrets = self._sendable(await self._publish_secret(pv))
        req = csi_pb2.ControllerUnpublishVolumeRequest(
            volume_id=vol.handle, node_id=self._node_id(va), secrets=secrets
        )
        try:
            await self.csi.controller.ControllerUnpublishVolume(req, timeout=self.options.timeout)
        except grpc.aio.AioRpcError as exc:
            # Every error, NotFound included, leaves the VA for another try: csi-attacher trusts
            # only an OK answer (a driver that found nothing to unpublish must say OK).
            raise call_failed("ControllerUnpublishVolume", name, exc) from exc
        # The finalizer first: a deleted VA without it counts as detached whatever its status says.
        finalizers = va["metadata"].get("finalizers") or []
        remaining = [f for f in finalizers if f != self.finalizer]
        if self.finalizer in finalizers:
            try:
                await self._patch_metadata(VOLUME_ATTACHMENTS, va, {"finalizers": remaining})
            except ApiError as exc:
                if not exc.not_found:
                    raise
                remaining = []
        # Without another finalizer the deleted VA is gone now: no status left to write (the write
        # would only come back 404 while the worker waits for it).
        if remaining:
            status = {"attached": False, "detachError": None, "attachmentMetadata": None}
            try:
                await self.client.patch(VOLUME_ATTACHMENTS, name, {"status": status}, subresource="status")
            except ApiError as exc:
                if not exc.not_found:
                    raise
        log.info("detached", va=name, pv=va_pv_name(va), node=va["spec"]["nodeName"])

    async def _ensure_va_finalizer(self, va: VolumeAttachment, node_id: str) -> VolumeAttachment:
        finalizers = va["metadata"].get("finalizers") or []
        annotations = va["metadata"].get("annotations") or {}
        if self.finalizer in finalizers and annotations.get(ANN_VA_NODE_ID) == node_id:
            return va
        change: Obj = {"annotations": {ANN_VA_NODE_ID: node_id}}
        if self.finalizer not in finalizers:
            change["finalizers"] = [*finalizers, self.finalizer]
        try:
            saved = await self._patch_metadata(VOLUME_ATTACHMENTS, va, change)  # 409 → requeue
        except ApiError as exc:
            raise AttachError(f"could not save VolumeAttachment: {exc.message}") from exc
        self.va_view.mutated(saved)
        return volume_attachment_view(saved)

    async def _ensure_pv_finalizer(self, pv: PersistentVolume) -> None:
        # Several VAs of one PV (ReadOnlyMany on two nodes) race to add the same finalizer. A 409
        # means someone else wrote the PV first: read it again rather than report a failed attach.
        # (The patch names the resourceVersion read, so it cannot drop a finalizer added meanwhile.)
        for attempt in range(PV_FINALIZER_TRIES):
            finalizers = pv["metadata"].get("finalizers") or []
            if self.finalizer in finalizers:
                return
            try:
                await self._patch_metadata(
                    PERSISTENT_VOLUMES, pv, {"finalizers": [*finalizers, self.finalizer]}
                )
                return
            except ApiError as exc:
                if not exc.conflict or attempt == PV_FINALIZER_TRIES - 1:
                    raise AttachError(f"could not add PersistentVolume finalizer: {exc.message}") from exc
            try:
                pv = pv_view(await self.client.get(PERSISTENT_VOLUMES, pv["metadata"]["name"]))
            except ApiError as exc:
                raise AttachError(f"could not add PersistentVolume finalizer: {exc.message}") from exc

    async def _patch_metadata(self, res: Resource, obj: KubeObject, change: Obj) -> Obj:
        """Writes `change` into the object's metadata with a merge patch (csi-attacher patches PVs
        and VolumeAttachments; its published RBAC grants `patch`, not `update`). The patch carries
        the resourceVersion read, which the apiserver enforces: a stale one fails with 409 as an
        update would, so a finalizer list written whole never drops one added meanwhile."""
        md = obj["metadata"]
        version = {"resourceVersion": md["resourceVersion"]} if md.get("resourceVersion") else {}
        return await self.client.patch(res, md["name"], {"metadata": {**change, **version}})

    async def _set_error(
        self, va: VolumeAttachment, field: str, message: str, code: int | None = None
    ) -> None:
        error: Obj = {"time": now_rfc3339(), "message": message}
        if code is not None:
            error["errorCode"] = code
        status = {field: error}
        try:
            await self.client.patch(
                VOLUME_ATTACHMENTS, va["metadata"]["name"], {"status": status}, subresource="status"
            )
        except ApiError as exc:
            log.warning("could not record error", va=va["metadata"]["name"], error=str(exc))

    # -- PV finalizer -----------------------------------------------------------------------------

    async def sync_pv(self, name: str) -> float | None:
        """Lets go of a PV that is being deleted once no VolumeAttachment (of any driver) names it.
        A PV that is not being deleted keeps the finalizer, as with csi-attacher."""
        pv = pv_view(self.pvs.store.get(name))
        if pv is None or not self.can_publish:
            return None
        if not pv["metadata"].get("deletionTimestamp"):
            return None
        if self.finalizer not in (pv["metadata"].get("finalizers") or []):
            return None
        checked = self.clock.monotonic()
        if self.vas.store.by_index(VA_BY_PV, name):
            return None
        # The cache may lag behind a VA just created for this PV: ask the API before letting go.
        items = await self._vas_listed_after(checked)
        if any(va_pv_name(volume_attachment_view(va)) == name for va in items):
            return None
        remaining = [f for f in pv["metadata"]["finalizers"] if f != self.finalizer]
        try:
            await self._patch_metadata(PERSISTENT_VOLUMES, pv, {"finalizers": remaining})
        except ApiError as exc:
            if not exc.not_found:
                raise
        return None

    async def _vas_listed_after(self, after: float) -> list[Obj]:
        """Every VolumeAttachment, from a list begun at or after `after` (so it holds everything
        created before then). PVs checked while one such list is under way share it: when many
        PVs are deleted together that is one LIST for all of them instead of one each."""
        current = self._va_list
        if current is None or current[0] < after:

            async def list_vas() -> list[Obj]:
                items, _ = await self.client.list_all(VOLUME_ATTACHMENTS)
                return items

            current = (self.clock.monotonic(), asyncio.create_task(list_vas()))
            self._va_list = current
        return await asyncio.shield(current[1])

    # -- ListVolumes reconciliation ---------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await self.clock.sleep(self.options.reconcile_sync)
            try:
                await self.reconcile_published()
            except Exception as exc:
                log.warning("ListVolumes reconciliation failed", error=error_text(exc))

    async def reconcile_published(self) -> int:
        """Compares every VA of the driver (being deleted or not) with the nodes ListVolumes says
        each volume is published on; a VA whose status.attached disagrees is queued for a forced
        sync (attach again, or detach again), never written to directly. Returns how many."""
        started = self.clock.monotonic()
        published: dict[str, set[str]] = {}
        token = ""
        while True:
            resp = await self.csi.controller.ListVolumes(
                csi_pb2.ListVolumesRequest(starting_token=token), timeout=self.options.timeout
            )
            for entry in resp.entries:
                if entry.HasField("volume") and entry.HasField("status"):
                    published[entry.volume.volume_id] = set(entry.status.published_node_ids)
            token = resp.next_token
            if not token:
                break
        queued = 0
        for name in list(self.vas.store.keys()):
            va = volume_attachment_view(self.va_view.get(name))
            if va is None or not self._ours(va):
                continue
            try:
                node_id = self._node_id(va)
                vol = self._csi_source(self._pv_of(va))
            except AttachError:
                continue  # nothing to compare with: csi-attacher skips it too
            attached = bool(va.get("status", {}).get("attached"))
            if attached == (node_id in published.get(vol.handle, set())):
                continue
            log.warning(
                "VolumeAttachment status and the driver's published nodes disagree, syncing it again",
                va=name,
                attached=attached,
                node=node_id,
            )
            self._force_sync.add(name)
            self.va_queue.add(name)
            queued += 1
        log.debug(
            "ListVolumes reconciled",
            volumes=len(published),
            queued=queued,
            took=f"{self.clock.monotonic() - started:.3f}s",
        )
        return queued
