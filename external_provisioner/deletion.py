"""The deletion controller (the volume half of sig-storage-lib-external-provisioner's provision
controller): the PVs this provisioner is responsible for (decide.responsible_for: provisioned by
the driver, or static CSI volumes of it) get the finalizer
external-provisioner.volume.kubernetes.io/finalizer while Bound with policy Delete and lose it with
Retain or Recycle; a Released one with policy Delete gets DeleteVolume, then the PV is deleted and
the finalizer goes. One queue of PV names, per-name exponential backoff.

In node deployment only the volumes this node can reach are its own (upstream: the node's
NodeGetInfo topology satisfies the PV's node affinity); every other node's provisioner leaves a PV
alone, without an event, as upstream's ignored deletion does."""

from __future__ import annotations

from collections.abc import Callable

from controller_runtime import storage
from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.kinds import (
    PersistentVolume,
    as_obj,
    pv_view,
    storage_class_view,
    volume_attachment_view,
)
from controller_runtime.logs import get_logger
from controller_runtime.resources import (
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    VOLUME_ATTACHMENTS,
    Obj,
    typed,
)
from controller_runtime.storage import is_deleting, volume_class
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from . import decide, names
from .options import Options
from .request import ProvisionError
from .volume_calls import VolumeCalls

log = get_logger("external-provisioner")

VA_BY_PV_INDEX = "pv"


class DeletionController(SidecarController):
    def __init__(
        self,
        context: ControllerContext,
        csi: CSIConnection,
        options: Options,
        volume_deleted: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(context, csi)
        self.options = options
        self.volume_deleted = volume_deleted  # the capacity publisher's refresh, in node deployment
        node = options.node_deployment
        self.segment = node.segment if node is not None else None
        self.calls = VolumeCalls(self.client, csi)
        # Without PUBLISH_UNPUBLISH_VOLUME nothing attaches the driver's volumes: no
        # VolumeAttachment can hold a deletion back.
        can_attach = csi.has_controller_capability(
            csi_pb2.ControllerServiceCapability.RPC.PUBLISH_UNPUBLISH_VOLUME
        )
        self.queue: WorkQueue[str] = WorkQueue(
            "volumes", ItemExponentialRateLimiter(options.retry_start, options.retry_max), clock=self.clock
        )
        self.volumes = self.factory.informer(PERSISTENT_VOLUMES)
        self.classes = self.factory.informer(STORAGE_CLASSES)
        self.volumes.add_handler(
            EventHandler(self._volume_changed, lambda _o, v: self._volume_changed(v), None)
        )
        # Watched only when something can attach (as upstream): a node-local driver's provisioner
        # runs on every node, and each would otherwise keep every VolumeAttachment of the cluster.
        self.attachments: SharedInformer | None = None
        if can_attach:
            self.attachments = self.factory.informer(VOLUME_ATTACHMENTS)
            self.attachments.add_index(
                VA_BY_PV_INDEX,
                lambda va: [n] if (n := va["spec"]["source"].get("persistentVolumeName")) else [],
            )
            self.attachments.add_handler(EventHandler(None, None, self._attachment_deleted))

    def _mine(self, pv: PersistentVolume) -> bool:
        return decide.responsible_for(pv, self.driver) and (
            self.segment is None or decide.volume_accessible(pv, self.segment)
        )

    def _volume_changed(self, obj: Obj) -> None:
        # Only a PV the sync would act on: every provisioned PV changes a few times on its way to
        # Bound (its create, the binder's status), and a sync of each was a queue round trip and
        # a view for nothing. The sync decides again from the cache.
        pv = pv_view(obj)
        if self._mine(pv) and (decide.finalizers_after(pv) is not None or decide.should_delete(pv)):
            self.queue.add(pv["metadata"]["name"])

    def _attachment_deleted(self, obj: Obj) -> None:
        pv = volume_attachment_view(obj).get("spec", {}).get("source", {}).get("persistentVolumeName")
        if pv:
            self.queue.add(pv)

    async def run(self) -> None:
        """The workers, on caches the caller has synced."""
        await run_workers(self.queue, self.sync, self.options.workers)

    async def sync(self, name: str) -> float | None:
        pv = pv_view(self.volumes.store.get(name))
        if pv is None or not self._mine(pv):
            return None
        finalizers = decide.finalizers_after(pv)
        if finalizers is not None:
            pv = pv_view(await self._patch_finalizer(name, keep=names.PV_FINALIZER in finalizers))
            if pv is None:
                return None
        if not decide.should_delete(pv):
            return None
        try:
            await self._delete_backing_volume(pv)
        except ProvisionError as exc:
            self.recorder.warning(
                typed(as_obj(pv), PERSISTENT_VOLUMES), storage.VOLUME_FAILED_DELETE, str(exc)
            )
            raise
        md = pv["metadata"]
        if not is_deleting(pv):
            try:
                pv = pv_view(await self.client.delete(PERSISTENT_VOLUMES, name, uid=md["uid"]))
            except ApiError as exc:
                if exc.not_found:
                    return None
                raise
        if names.PV_FINALIZER in (pv.get("metadata", {}).get("finalizers") or []):
            await self._patch_finalizer(name, keep=False)
        log.info("deleted volume", volume=name, handle=pv["spec"]["csi"]["volumeHandle"])
        return None

    async def _delete_backing_volume(self, pv: PersistentVolume) -> None:
        """DeleteVolume for a Released PV, in the sidecar's order: the driver must be able to,
        the provisioner secret is looked up (a missing Secret is no reason to keep the volume:
        DeleteVolume goes without it), and no VolumeAttachment may still name the PV."""
        name, csi = pv["metadata"]["name"], pv["spec"].get("csi")
        if csi is None:
            raise ProvisionError("invalid CSI PV")
        problem = decide.capability_error(
            self.csi.plugin_capabilities, self.csi.controller_capabilities, source=None, modify=False
        )
        if problem is not None:
            raise ProvisionError(problem)
        class_name = volume_class(pv)
        storage_class = storage_class_view(self.classes.store.get(class_name)) if class_name else None
        ref = decide.deletion_secret(pv, storage_class)
        secrets = await self.calls.secrets(ref, required=False)
        if self.attachments is not None:
            for va in map(volume_attachment_view, self.attachments.store.by_index(VA_BY_PV_INDEX, name)):
                raise ProvisionError(names.msg_still_attached(name, va["spec"].get("nodeName", "")))
        await self.calls.delete_volume(csi["volumeHandle"], secrets)
        if self.volume_deleted is not None:
            self.volume_deleted()

    async def _patch_finalizer(self, name: str, *, keep: bool) -> Obj | None:
        """Adds or removes our finalizer on the PV (None when the PV is gone). A strategic merge
        patch of that one entry, without a resourceVersion, as the Go sidecar sends: the binder
        and the protection controller write the PV at the same moments, and a precondition would
        only turn their writes into conflicts and whole re-syncs (each one more API request
        against the same rate limit as this sidecar's events)."""
        if keep:
            patch: Obj = {"metadata": {"finalizers": [names.PV_FINALIZER]}}
        else:
            patch = {"metadata": {"$deleteFromPrimitiveList/finalizers": [names.PV_FINALIZER]}}
        try:
            return await self.client.patch(PERSISTENT_VOLUMES, name, patch, patch_type="strategic")
        except ApiError as exc:
            if exc.not_found:
                return None
            raise
