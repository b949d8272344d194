"""The volume manager, kubelet's part that mounts volumes (pkg/kubelet/volumemanager), put
together from its parts as kubelet's is:

    desired_state.DesiredStateOfWorld          the CSI volumes the pods on this node want
    populator.DesiredStateOfWorldPopulator     fills it from the informers' caches
    actual_state.ActualStateOfWorld            the publishes and stagings begun, and which are mounted
    reconciler.Reconciler                      compares the two and starts the operations
    operation_generator.OperationGenerator     stage+publish, unpublish, unstage, node expansion

and what the rest of the agent asks of it: the pods' mount state (pod status) and the mounted
claims' volumes (volume metrics).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping

from controller_runtime.clock import SYSTEM_CLOCK, Clock
from controller_runtime.csi_client import error_text
from controller_runtime.events import EventRecorder
from controller_runtime.informer import EventHandler, SharedInformerFactory
from controller_runtime.kinds import pod_view, pv_view
from controller_runtime.logs import get_logger
from controller_runtime.operations import Backoff, OperationExecutor
from controller_runtime.resources import (
    CSI_DRIVERS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
)

from .actual_state import ActualStateOfWorld, VolumeKey
from .decide import PodVolume
from .desired_state import DesiredStateOfWorld
from .disk import Layout, remove_pod_dir
from .expansion import NodeExpander
from .operation_generator import OperationGenerator
from .plugins import Plugin
from .populator import DesiredStateOfWorldPopulator
from .reconciler import Reconciler
from .volume_stats import ClaimRef, StatsTarget

log = get_logger("node-agent")


def pods_on_node(node_name: str) -> str:
    """The field selector of the pods bound to the node (kubelet's pod informer)."""
    return f"spec.nodeName={node_name}"


class VolumeManager:
    def __init__(
        self,
        informers: SharedInformerFactory,
        recorder: EventRecorder,
        node_name: str,
        layout: Layout,
        plugins: Mapping[str, Plugin],
        *,
        csi_timeout: float,
        backoff: Backoff,
        max_concurrent_operations: int,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.layout = layout
        self.plugins = plugins
        self.pods = informers.informer(PODS, field_selector=pods_on_node(node_name))
        node = informers.informer(NODES, field_selector=f"metadata.name={node_name}")
        pvs = informers.informer(PERSISTENT_VOLUMES)
        pvcs = informers.informer(PERSISTENT_VOLUME_CLAIMS)
        vas = informers.informer(VOLUME_ATTACHMENTS)
        drivers = informers.informer(CSI_DRIVERS)
        # Set by informer events and finished operations: time for another pass.
        self.wake = asyncio.Event()
        for informer in (self.pods, node, vas, pvs, pvcs):
            informer.add_handler(_waker(self.wake))
        self.desired = DesiredStateOfWorld()
        self.actual = ActualStateOfWorld()
        # Volume operations (stage+publish, unpublish, unstage, expand) one per volume; at most
        # `max_concurrent_operations` at once (0 = no limit, as kubelet's operation executor),
        # started in the order queued (an unstage first: it finishes a volume), so on a busy node
        # the first pods finish first instead of every operation sharing the CPU and all finishing
        # at the end.
        self.operations = OperationExecutor[VolumeKey](
            "node-volumes",
            backoff=backoff,
            max_concurrent=max_concurrent_operations,
            clock=clock,
            on_done=self.wake.set,
            describe_error=error_text,
            logger=log,
        )
        self.generator = OperationGenerator(
            self.actual,
            recorder,
            NodeExpander(informers.client, recorder, node_name, csi_timeout),
            node_name,
            layout,
            plugins,
            pods=self.pods.store,
            volumes=pvs.store,
            attachments=vas.store,
            drivers=drivers.store,
            csi_timeout=csi_timeout,
        )
        populator = DesiredStateOfWorldPopulator(
            self.desired, pods=self.pods.store, claims=pvcs.store, volumes=pvs.store, drivers=drivers.store
        )
        self.reconciler = Reconciler(
            informers.client,
            node_name,
            layout,
            desired=self.desired,
            actual=self.actual,
            populator=populator,
            generator=self.generator,
            operations=self.operations,
            node=node.store,
            claims=pvcs.store,
            volumes=pvs.store,
            clock=clock,
        )
        self.deciding = self.reconciler.deciding  # the CPU a pass spends deciding (paces the passes)
        self._volumes = pvs.store

    async def reconcile(self) -> dict[str, tuple[PodVolume, ...]]:
        """One pass; returns, per pod key whose claims all resolve, its volumes (for pod status)."""
        return await self.reconciler.reconcile()

    async def stop(self) -> None:
        await self.operations.shutdown()

    def restore_from_disk(self) -> None:
        self.reconciler.restore_from_disk()

    async def unmount_all(self) -> tuple[int, int]:
        """Unpublishes and unstages every volume recorded on disk, for a node that shuts down;
        returns (volumes done, volumes left). Called after `stop`."""
        return await self.reconciler.unmount_all()

    def remove_orphan_pod_dirs(self) -> None:
        """Pod directories of pods that are gone and hold no volume record: left by a crash after
        the last unpublish. Directories with records are handled by the unmount path."""
        known = {p["metadata"].get("uid") for p in map(pod_view, self.pods.store.values())}
        with_records = {uid for uid, _ in self.actual.get_all_mounted_volumes()}
        for uid in self.layout.pod_dirs():
            if uid not in known and uid not in with_records:
                remove_pod_dir(self.layout.root / "pods" / uid)

    # -- what the pod status and the volume metrics read ----------------------------------------------

    def pod_could_have_mounted_volumes(self, pod_uid: str) -> bool:
        """Whether a publish of the pod was begun and not yet undone."""
        return bool(self.actual.get_possibly_mounted_volumes_for_pod(pod_uid))

    def all_mounted(self, volumes: Iterable[PodVolume]) -> bool:
        return all(self.actual.pod_exists_in_volume(*v.key) for v in volumes)

    def stats_targets(self) -> list[StatsTarget]:
        """The mounted publishes of claims' volumes, as kubelet's volume metrics measure them
        (inline volumes have no claim)."""
        out = []
        for m in self.actual.get_mounted_volumes():
            if m.ephemeral:
                continue
            pv = pv_view(self._volumes.get(m.pv_name)) or {}
            ref = (pv.get("spec") or {}).get("claimRef") or {}
            plugin = self.plugins.get(m.driver)
            if not ref.get("name") or plugin is None or not plugin.volume_stats:
                continue
            staging = self.layout.staging_path(m.driver, m.handle) if plugin.stage_unstage else ""
            out.append(
                StatsTarget(
                    ClaimRef(str(ref.get("namespace") or ""), str(ref["name"])),
                    m.driver,
                    m.handle,
                    str(self.layout.target_path(m.pod_uid, m.pv_name, m.block)),
                    str(staging),
                )
            )
        return out


def _waker(event: asyncio.Event) -> EventHandler:
    """A handler that only wakes the reconcile loop (business logic stays in the loop)."""
    return EventHandler(lambda _o: event.set(), lambda _o, _n: event.set(), lambda _o: event.set())
