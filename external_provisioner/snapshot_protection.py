"""The snapshot source protection: the finalizer
provisioner.storage.kubernetes.io/volumesnapshot-as-source-protection keeps a VolumeSnapshot while
a claim restores from it. The provisioning controller asks for it (`protect`) before a restore's
first CreateVolume and gives it back (`release`) once the PV is saved; a sweep every
--snapshot-orphan-sweep-interval takes it off every snapshot no unbound claim restores from any
more (a restore that failed for good, a claim deleted mid-way, a crash between the PV and the
release), so no release that was missed keeps a snapshot for ever."""

from __future__ import annotations

from controller_runtime.client import ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection, SidecarController
from controller_runtime.kinds import VolumeSnapshot, pvc_view, snapshot_view
from controller_runtime.logs import get_logger
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, VOLUME_SNAPSHOTS, key_of
from kubeloop_grpc.csi import csi_pb2

from . import decide, names
from .decide import DataSource
from .options import Options
from .request import ProvisionError

log = get_logger("external-provisioner")


class SnapshotProtectionController(SidecarController):
    def __init__(self, context: ControllerContext, csi: CSIConnection, options: Options) -> None:
        super().__init__(context, csi)
        # Only a driver that restores snapshots can have left a protection behind.
        self.restores_snapshots = csi.has_controller_capability(
            csi_pb2.ControllerServiceCapability.RPC.CREATE_DELETE_SNAPSHOT
        )
        self.interval = options.snapshot_sweep_interval
        self.claims = self.factory.informer(PERSISTENT_VOLUME_CLAIMS)

    async def protect(self, source: DataSource) -> None:
        """Puts the finalizer on the VolumeSnapshot a claim restores from, so it stays while the
        restore runs. Without the RBAC to update snapshots, provisioning goes on unprotected, as
        upstream (the permission is optional there)."""
        try:
            snap = snapshot_view(await self.client.get(VOLUME_SNAPSHOTS, source.name, source.namespace))
            finalizers = list(snap["metadata"].get("finalizers") or [])
            if names.SNAPSHOT_FINALIZER in finalizers:
                return
            finalizers.append(names.SNAPSHOT_FINALIZER)
            patch = {
                "metadata": {"resourceVersion": snap["metadata"]["resourceVersion"], "finalizers": finalizers}
            }
            await self.client.patch(VOLUME_SNAPSHOTS, source.name, patch, source.namespace)
        except ApiError as exc:
            if exc.forbidden:
                log.info(
                    "no permission to protect the snapshot source", snapshot=source.name, error=exc.message
                )
                return
            raise ProvisionError(exc.message) from exc

    async def release(self, namespace: str, name: str, snap: VolumeSnapshot | None = None) -> None:
        """Takes the finalizer off a snapshot. Failures are only logged: the sweep (or the next
        restore from it) finishes the job."""
        try:
            if snap is None:
                snap = snapshot_view(await self.client.get(VOLUME_SNAPSHOTS, name, namespace))
            finalizers = list(snap["metadata"].get("finalizers") or [])
            if names.SNAPSHOT_FINALIZER not in finalizers:
                return
            rest = [f for f in finalizers if f != names.SNAPSHOT_FINALIZER]
            patch = {
                "metadata": {
                    "resourceVersion": snap["metadata"]["resourceVersion"],
                    "finalizers": rest or None,
                }
            }
            await self.client.patch(VOLUME_SNAPSHOTS, name, patch, namespace)
        except ApiError as exc:
            if not (exc.not_found or exc.forbidden):
                log.warning(
                    "could not release the snapshot source", snapshot=f"{namespace}/{name}", error=exc.message
                )
            return
        log.info("released the snapshot source", snapshot=f"{namespace}/{name}")

    async def run(self) -> None:
        """The sweep, on caches the caller has synced. Off without CREATE_DELETE_SNAPSHOT, with
        an interval of 0, without the snapshot API, or without the RBAC to list snapshots."""
        if self.interval <= 0 or not self.restores_snapshots:
            return
        try:
            await self.client.list_page(VOLUME_SNAPSHOTS, limit=1)
        except ApiError as exc:
            if exc.forbidden or exc.not_found:
                log.info("snapshot source sweep off", reason=exc.message)
                return
        while True:
            try:
                await self._sweep()
            except Exception as exc:  # a failed round must not stop provisioning; the next one retries
                log.warning("snapshot source sweep failed", error=str(exc) or type(exc).__name__)
            await self.clock.sleep(self.interval)

    async def _sweep(self) -> None:
        snapshots, _ = await self.client.list_all(VOLUME_SNAPSHOTS)
        pending = decide.pending_restores(pvc_view(c) for c in self.claims.store.values())
        for snap in map(snapshot_view, snapshots):
            md = snap["metadata"]
            if names.SNAPSHOT_FINALIZER in (md.get("finalizers") or []) and key_of(snap) not in pending:
                await self.release(md["namespace"], md["name"], snap)
