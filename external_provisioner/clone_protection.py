"""The cloning-protection controller (upstream's CloningProtectionController,
pkg/controller/clone_controller.go): the finalizer provisioner.storage.kubernetes.io/cloning-protection
keeps a clone's source claim while the driver copies it. The provisioning controller asks for it
(`protect`) before a clone's first CreateVolume; this controller takes it off once the source is
being deleted and no claim cloning it is Pending. Only a driver with CLONE_VOLUME runs it, as
upstream."""

from __future__ import annotations

from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext, run_workers
from controller_runtime.csi_client import CSIConnection, SidecarController
from controller_runtime.informer import EventHandler
from controller_runtime.kinds import as_obj, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, Obj, key_of, object_key
from controller_runtime.storage import is_deleting
from controller_runtime.workqueue import ItemExponentialRateLimiter, WorkQueue
from kubeloop_grpc.csi import csi_pb2

from . import decide, names
from .claims import update_claim_metadata
from .decide import DataSource
from .options import Options
from .request import ProvisionError

log = get_logger("external-provisioner")


class ClonesPending(Exception):
    """The source being deleted is still the source of a Pending clone: it keeps its protection
    and is looked at again with backoff (no event, as upstream)."""


class CloneProtectionController(SidecarController):
    def __init__(self, context: ControllerContext, csi: CSIConnection, options: Options) -> None:
        super().__init__(context, csi)
        self.options = options
        self.enabled = csi.has_controller_capability(csi_pb2.ControllerServiceCapability.RPC.CLONE_VOLUME)
        # Sources being deleted, keyed namespace/name.
        self.queue: WorkQueue[str] = WorkQueue(
            "clone-sources",
            ItemExponentialRateLimiter(options.retry_start, options.retry_max),
            clock=self.clock,
        )
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)
        # The claims as this controller's own finalizer patches left them: a second clone of a
        # source in one round must not patch it again.
        self.claim_view = MutationCache(self.claims.store, clock=self.clock)
        if self.enabled:
            self.claims.add_handler(
                EventHandler(
                    self._claim_changed, lambda _o, c: self._claim_changed(c), self.claim_view.deleted
                )
            )

    def _claim_changed(self, obj: Obj) -> None:
        claim = pvc_view(obj)
        if is_deleting(claim) and names.CLONE_FINALIZER in (claim["metadata"].get("finalizers") or []):
            self.queue.add(key_of(claim))

    async def run(self) -> None:
        """The workers, on caches the caller has synced."""
        if self.enabled:
            await run_workers(self.queue, self.sync, self.options.workers)

    async def protect(self, source: DataSource) -> None:
        """Puts the finalizer on the source claim before the first CreateVolume that copies it, so
        the source cannot vanish while the driver copies. An update of the cached claim, as
        csi-provisioner's: a stale cache is a conflict, reported and retried."""
        src = pvc_view(self.claim_view.get(object_key(source.namespace, source.name)))
        if src is None:
            raise ProvisionError(f'persistentvolumeclaim "{source.name}" not found')
        md = src["metadata"]
        finalizers = list(md.get("finalizers") or [])
        if names.CLONE_FINALIZER in finalizers:
            return
        finalizers.append(names.CLONE_FINALIZER)
        try:
            saved = await update_claim_metadata(self.client, as_obj(src), finalizers=finalizers)
        except ApiError as exc:
            raise ProvisionError(exc.message) from exc
        self.claim_view.mutated(saved)  # a second clone of it in this round must not patch again

    async def sync(self, key: str) -> float | None:
        """The finalizer goes once no claim is Pending with the source as its data source.
        Level-triggered from the cache, so a restart anywhere converges: the initial list
        re-queues every deleting source."""
        src = pvc_view(self.claim_view.get(key))
        if src is None or names.CLONE_FINALIZER not in (src["metadata"].get("finalizers") or []):
            return None
        pending = decide.pending_clones(src, (pvc_view(c) for c in self.claims.store.values()))
        if pending:
            raise ClonesPending(f"PVC '{pending[0]}' is in 'Pending' state, cloning in progress")
        md = src["metadata"]
        rest = [f for f in md.get("finalizers") or [] if f != names.CLONE_FINALIZER]
        try:
            await update_claim_metadata(self.client, as_obj(src), finalizers=rest)
        except ApiError as exc:
            if not exc.not_found:
                raise
        log.info("removed the cloning protection", claim=key)
        return None
