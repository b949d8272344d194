"""The external-attacher's controller: VolumeAttachments of one driver, one idempotent sync each.

Attach: finalizers on the VA and the PV first (so neither can vanish while the driver may have
published the volume), then ControllerPublishVolume, then status.attached with the publish context.
Detach (VA being deleted): ControllerUnpublishVolume, then drop the VA finalizer; the PV finalizer
goes once no VolumeAttachment names the PV any more. Failures are written to attachError /
detachError and retried with per-key exponential backoff. A periodic pass compares ListVolumes'
published nodes with the VAs and re-attaches what the driver forgot.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass

import grpc

from controller_runtime.client import ApiError
from controller_runtime.clock import now_rfc3339
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController, SidecarOptions, error_text
from controller_runtime.informer import EventHandler
from controller_runtime.logs import get_logger
from controller_runtime.resources import CSI_NODES, PERSISTENT_VOLUMES, VOLUME_ATTACHMENTS, Obj
from controller_runtime.volumes import attacher_finalizer, csi_volume, volume_capability
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


@dataclass(frozen=True)
class Options(SidecarOptions):
    timeout: float = 15.0
    reconcile_sync: float = 60.0
    pv_workers: int = 4


class AttachError(Exception):
    pass


def va_pv_name(va: Obj) -> str:
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
        limiter: MaxOfRateLimiter[str] = MaxOfRateLimiter(
            ItemExponentialRateLimiter(self.options.retry_start, self.options.retry_max),
            BucketRateLimiter(100.0, 1000),
        )
        self.va_queue: WorkQueue[str] = WorkQueue("volumeattachments", limiter)
        self.pv_queue: WorkQueue[str] = WorkQueue(
            "persistentvolumes",
            MaxOfRateLimiter(
                ItemExponentialRateLimiter(self.options.retry_start, self.options.retry_max),
                BucketRateLimiter(100.0, 1000),
            ),
        )
        self.vas = self.factory.informer(VOLUME_ATTACHMENTS)
        self.pvs = self.factory.informer(PERSISTENT_VOLUMES)
        self.csinodes = self.factory.informer(CSI_NODES)
        self.vas.add_index(VA_BY_PV, lambda va: [n] if (n := va_pv_name(va)) else [])
        self.vas.add_handler(EventHandler(self._va_changed, lambda _o, n: self._va_changed(n), self._va_gone))
        # The VolumeAttachment list that PV checks begun before it started may share.
        self._va_list: tuple[float, asyncio.Task[list[Obj]]] | None = None
        self.pvs.add_handler(EventHandler(self._pv_changed, lambda _o, n: self._pv_changed(n), None))

    # -- handlers: enqueue only -------------------------------------------------------------------

    def _ours(self, va: Obj) -> bool:
        return bool(va.get("spec", {}).get("attacher") == self.driver)

    def _va_changed(self, va: Obj) -> None:
        if self._ours(va):
            self.va_queue.add(va["metadata"]["name"])

    def _va_gone(self, va: Obj) -> None:
        if self._ours(va) and (pv := va_pv_name(va)):
            self.pv_queue.add(pv)

    def _pv_changed(self, pv: Obj) -> None:
        if self.finalizer in (pv.get("metadata", {}).get("finalizers") or []):
            self.pv_queue.add(pv["metadata"]["name"])

    async def run(self) -> None:
        await self.start_informers()
        log.info("caches synced, starting workers", driver=self.driver, workers=self.options.workers)
        tasks = [
            asyncio.create_task(run_workers(self.va_queue, self.sync_va, self.options.workers)),
            asyncio.create_task(run_workers(self.pv_queue, self.sync_pv, self.options.pv_workers)),
        ]
        if self.can_list and self.options.reconcile_sync > 0:
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
        va = self.vas.store.get(name)
        if va is None or not self._ours(va):
            return None
        if va["metadata"].get("deletionTimestamp"):
            await self._detach(va)
            return None
        if va.get("status", {}).get("attached"):
            return None
        await self._attach(va)
        return None

    def _node_id(self, node: str) -> str:
        csinode = self.csinodes.store.get(node)
        for drv in (csinode or {}).get("spec", {}).get("drivers") or []:
            if drv.get("name") == self.driver:
                return str(drv.get("nodeID") or "")
        return ""

    async def _attach(self, va: Obj) -> None:
        name = va["metadata"]["name"]
        if va["spec"].get("source", {}).get("inlineVolumeSpec"):
            raise AttachError(f"{name}: inline volumes are not supported")
        pv_name = va_pv_name(va)
        pv = self.pvs.store.get(pv_name)
        if pv is None:
            await self._set_error(va, "attachError", f"PersistentVolume {pv_name!r} not found")
            raise AttachError(f"{name}: PV {pv_name} not found")
        # Both finalizers before the driver is asked, written side by side (two requests, one
        # round trip of latency).
        va_result, pv_result = await asyncio.gather(
            self._ensure_va_finalizer(va), self._ensure_pv_finalizer(pv), return_exceptions=True
        )
        for result in (va_result, pv_result):
            if isinstance(result, BaseException):
                raise result
        assert isinstance(va_result, dict)
        va = va_result
        context: dict[str, str] = {}
        if self.can_publish:
            vol = csi_volume(pv)
            if vol is None or vol.driver != self.driver:
                await self._set_error(
                    va, "attachError", f"PersistentVolume {pv_name!r} is not a {self.driver} volume"
                )
                raise AttachError(f"{name}: PV {pv_name} is not ours")
            node = va["spec"]["nodeName"]
            node_id = self._node_id(node)
            if not node_id:
                msg = f"node {node!r} has no CSINode entry for driver {self.driver}"
                await self._set_error(va, "attachError", msg)
                raise AttachError(msg)
            req = csi_pb2.ControllerPublishVolumeRequest(
                volume_id=vol.handle,
                node_id=node_id,
                volume_capability=volume_capability(vol, self.single_node_multi_writer),
                readonly=vol.read_only,
                volume_context=vol.attributes,
            )
            try:
                resp = await self.csi.controller.ControllerPublishVolume(req, timeout=self.options.timeout)
            except Exception as exc:
                await self._set_error(va, "attachError", error_text(exc))
                raise AttachError(f"{name}: ControllerPublishVolume: {error_text(exc)}") from exc
            context = dict(resp.publish_context)
        status = {"attached": True, "attachmentMetadata": context or None, "attachError": None}
        await self.client.patch(VOLUME_ATTACHMENTS, name, {"status": status}, subresource="status")
        log.info("attached", va=name, pv=pv_name, node=va["spec"]["nodeName"])

    async def _detach(self, va: Obj) -> None:
        name = va["metadata"]["name"]
        if self.finalizer not in (va["metadata"].get("finalizers") or []):
            return
        if self.can_publish:
            node = va["spec"]["nodeName"]
            node_id = self._node_id(node)
            pv = self.pvs.store.get(va_pv_name(va))
            vol = csi_volume(pv) if pv is not None else None
            if vol is None:
                msg = f"cannot detach: PersistentVolume {va_pv_name(va)!r} is gone or has no CSI source"
                await self._set_error(va, "detachError", msg)
                raise AttachError(msg)
            if not node_id:
                # CSINode is garbage-collected with its Node, yet a VA of a deleted node must still
                # be detachable: kubeloop's node plugins use the node name as their node id.
                node_id = node
            req = csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.handle, node_id=node_id)
            try:
                await self.csi.controller.ControllerUnpublishVolume(req, timeout=self.options.timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    await self._set_error(va, "detachError", error_text(exc))
                    raise AttachError(f"{name}: ControllerUnpublishVolume: {error_text(exc)}") from exc
                # NOT_FOUND: the volume or node is gone, so it is not published there.
        fresh = copy.deepcopy(va)
        fresh["metadata"]["finalizers"] = [
            f for f in fresh["metadata"].get("finalizers") or [] if f != self.finalizer
        ]
        try:
            await self.client.update(VOLUME_ATTACHMENTS, fresh)
        except ApiError as exc:
            if not exc.not_found:
                raise
        log.info("detached", va=name, pv=va_pv_name(va), node=va["spec"]["nodeName"])

    async def _ensure_va_finalizer(self, va: Obj) -> Obj:
        finalizers = va["metadata"].get("finalizers") or []
        if self.finalizer in finalizers:
            return va
        fresh = copy.deepcopy(va)
        fresh["metadata"]["finalizers"] = [*finalizers, self.finalizer]
        return await self.client.update(VOLUME_ATTACHMENTS, fresh)  # 409 → requeue

    async def _ensure_pv_finalizer(self, pv: Obj) -> None:
        finalizers = pv["metadata"].get("finalizers") or []
        if self.finalizer in finalizers:
            return
        fresh = copy.deepcopy(pv)
        fresh["metadata"]["finalizers"] = [*finalizers, self.finalizer]
        await self.client.update(PERSISTENT_VOLUMES, fresh)

    async def _set_error(self, va: Obj, field: str, message: str) -> None:
        status = {field: {"time": now_rfc3339(), "message": message}}
        try:
            await self.client.patch(
                VOLUME_ATTACHMENTS, va["metadata"]["name"], {"status": status}, subresource="status"
            )
        except ApiError as exc:
            log.warning("could not record error", va=va["metadata"]["name"], error=str(exc))

    # -- PV finalizer -----------------------------------------------------------------------------

    async def sync_pv(self, name: str) -> float | None:
        pv = self.pvs.store.get(name)
        if pv is None or self.finalizer not in (pv["metadata"].get("finalizers") or []):
            return None
        checked = time.monotonic()
        if any(self._ours(va) for va in self.vas.store.by_index(VA_BY_PV, name)):
            return None
        # The cache may lag behind a VA just created for this PV: ask the API before letting go.
        items = await self._vas_listed_after(checked)
        if any(self._ours(va) and va_pv_name(va) == name for va in items):
            return None
        fresh = copy.deepcopy(pv)
        fresh["metadata"]["finalizers"] = [f for f in pv["metadata"]["finalizers"] if f != self.finalizer]
        try:
            await self.client.update(PERSISTENT_VOLUMES, fresh)
        except ApiError as exc:
            if not exc.not_found:
                raise
        return None

    async def _vas_listed_after(self, after: float) -> list[Obj]:
        """Every VolumeAttachment, from a list begun at or after `after` (so it holds everything
        created before then). PVs checked while one such list is under way share it: when a node's
        volumes detach together that is one LIST for many PVs instead of one each."""
        current = self._va_list
        if current is None or current[0] < after:

            async def list_vas() -> list[Obj]:
                items, _ = await self.client.list_all(VOLUME_ATTACHMENTS)
                return items

            current = (time.monotonic(), asyncio.create_task(list_vas()))
            self._va_list = current
        return await asyncio.shield(current[1])

    # -- ListVolumes reconciliation ---------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.reconcile_sync)
            try:
                await self.reconcile_published()
            except Exception as exc:
                log.warning("ListVolumes reconciliation failed", error=error_text(exc))

    async def reconcile_published(self) -> int:
        """Marks attached VAs whose volume the driver does not report published on their node as
        not attached, so the next sync publishes again. Returns how many were repaired."""
        started = time.monotonic()
        published: dict[str, set[str]] = {}
        token = ""
        while True:
            resp = await self.csi.controller.ListVolumes(
                csi_pb2.ListVolumesRequest(starting_token=token), timeout=self.options.timeout
            )
            for entry in resp.entries:
                published[entry.volume.volume_id] = set(entry.status.published_node_ids)
            token = resp.next_token
            if not token:
                break
        repaired = 0
        for va in self.vas.store.values():
            if not self._ours(va) or va["metadata"].get("deletionTimestamp"):
                continue
            if not va.get("status", {}).get("attached"):
                continue
            pv = self.pvs.store.get(va_pv_name(va))
            vol = csi_volume(pv) if pv is not None else None
            node_id = self._node_id(va["spec"]["nodeName"])
            if vol is None or not node_id:
                continue
            if node_id in published.get(vol.handle, set()):
                continue
            log.warning("driver lost a publication, attaching again", va=va["metadata"]["name"], node=node_id)
            await self.client.patch(
                VOLUME_ATTACHMENTS,
                va["metadata"]["name"],
                {"status": {"attached": False}},
                subresource="status",
            )
            repaired += 1
        log.debug(
            "ListVolumes reconciled",
            volumes=len(published),
            repaired=repaired,
            took=f"{time.monotonic() - started:.3f}s",
        )
        return repaired
