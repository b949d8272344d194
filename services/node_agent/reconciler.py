"""The node agent's reconciler (kubelet's volumemanager/reconciler): a pass compares the desired
state with the actual state and starts, in kubelet's order from the pure `decide.plan_volumes`,
unpublish → stage+publish → unstage, then the node expansions its mounted volumes wait for; it
reports volumesInUse before anything is mounted and until it is unstaged. It also rebuilds the
actual state from disk at start (kubelet's reconstruction) and, for a node that shuts down,
unmounts everything on disk.

Every operation runs on one OperationExecutor keyed by (driver, volume handle): one operation per
volume at a time, each operation on it backing off on its own after a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from controller_runtime import mounts
from controller_runtime.client import ApiClient
from controller_runtime.clock import Clock
from controller_runtime.csi_client import error_text
from controller_runtime.kinds import node_view, pv_view, pvc_view
from controller_runtime.logs import get_logger
from controller_runtime.operations import OperationExecutor
from controller_runtime.passes import CpuMeter
from controller_runtime.resources import NODES
from controller_runtime.store import Store

from .actual_state import ActualStateOfWorld, VolumeKey
from .decide import Mounted, PodVolume, VolumePlan, plan_volumes, ready_to_mount
from .desired_state import DesiredStateOfWorld
from .disk import Layout, VolData
from .expansion import pending_size
from .operation_generator import OperationGenerator
from .populator import DesiredStateOfWorldPopulator

log = get_logger("node-agent")

# Operation priorities when operations wait for a slot; lower runs first. Unstaging finishes a
# volume that is already unpublished (its detach waits for nothing else), so it goes ahead of
# starting on another volume.
UNSTAGE = 0
UNPUBLISH = 1
MOUNT = 1
EXPAND = 1

# volumesInUse written this recently is not written again: the cache may not show the write yet.
IN_USE_ECHO_SECONDS = 2.0


class Reconciler:
    def __init__(
        self,
        client: ApiClient,
        node_name: str,
        layout: Layout,
        *,
        desired: DesiredStateOfWorld,
        actual: ActualStateOfWorld,
        populator: DesiredStateOfWorldPopulator,
        generator: OperationGenerator,
        operations: OperationExecutor[VolumeKey],
        node: Store,
        claims: Store,
        volumes: Store,
        clock: Clock,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.layout = layout
        self.desired = desired
        self.actual = actual
        self.populator = populator
        self.generator = generator
        self.operations = operations
        self.node = node
        self.claims = claims
        self.volumes = volumes
        self.clock = clock
        self.deciding = CpuMeter()  # the CPU a pass spends deciding (paces the passes)
        self._in_use_written: tuple[tuple[str, ...], float] | None = None

    async def reconcile(self) -> dict[str, tuple[PodVolume, ...]]:
        """One pass; returns, per pod key whose claims all resolve, its volumes (for pod status)."""
        desired, pods, plan = self._decide()
        if await self._write_in_use(plan.in_use):
            # Operations may have finished while the write was under way: decide on the state as
            # it is now, not as it was (a stale plan would unstage or unpublish a second time).
            desired, pods, plan = self._decide()
        node = self.node.get(self.node_name) or {}
        status = node.get("status") or {}
        in_use = set(status.get("volumesInUse") or ())
        attached = {v.get("name") for v in status.get("volumesAttached") or ()}

        ops, gen = self.operations, self.generator
        for m in plan.unmount:
            ops.run(
                m.stage_key,
                gen.unpublish(m),
                operation=("unpublish", m.pod_uid, m.pv_name),
                priority=UNPUBLISH,
            )
        for pv in plan.mount:
            if not ready_to_mount(pv, in_use, attached, gen.attach_required(pv.volume.driver)):
                continue
            mount = gen.mount_inline(pv) if pv.volume.ephemeral else gen.mount(pv)
            ops.run(pv.stage_key, mount, operation=("mount", *pv.key), priority=MOUNT)
        for skey in plan.unstage:
            ops.run(skey, gen.unstage(skey), operation="unstage", priority=UNSTAGE)
        for pv in self._expansions(desired):
            ops.run(pv.stage_key, gen.expand(pv), operation="expand", priority=EXPAND)
        return pods

    def _decide(self) -> tuple[tuple[PodVolume, ...], dict[str, tuple[PodVolume, ...]], VolumePlan]:
        """The desired state from the caches as they are now (the volumes to mount, and the pods
        whose claims all resolve), and the plan against the actual state as it is now."""
        with self.deciding:
            self.populator.populate()
            desired = self.desired.get_volumes_to_mount()
            plan = plan_volumes(
                desired,
                self.actual.get_all_mounted_volumes(),
                self.actual.get_mounted_volume_keys(),
                self.actual.get_possibly_mounted_devices(),
            )
            return desired, self.desired.get_pods_with_resolved_volumes(), plan

    def _expansions(self, desired: Sequence[PodVolume]) -> list[PodVolume]:
        """One mounted publish per volume whose claim waits for the node to grow it (from the
        cache; the operation reads the claim again before acting)."""
        out: dict[VolumeKey, PodVolume] = {}
        for pv in desired:
            if (
                not self.actual.pod_exists_in_volume(*pv.key)
                or pv.stage_key in out
                or self.actual.has_in_use_expansion_error(pv.stage_key)
            ):
                continue
            volume = pv_view(self.volumes.get(pv.volume.pv_name))
            ref = (volume or {}).get("spec", {}).get("claimRef") or {}
            claim = pvc_view(self.claims.get(f"{ref.get('namespace')}/{ref.get('name')}"))
            if volume is not None and claim is not None and pending_size(claim, volume) is not None:
                out[pv.stage_key] = pv
        return list(out.values())

    async def _write_in_use(self, names: tuple[str, ...]) -> bool:
        """Reports `names` as the node's volumesInUse; whether it had to write."""
        node = node_view(self.node.get(self.node_name))
        current = tuple(sorted((node or {}).get("status", {}).get("volumesInUse") or ()))
        if current == names:
            return False
        last = self._in_use_written
        if last is not None and last[0] == names and self.clock.monotonic() - last[1] < IN_USE_ECHO_SECONDS:
            return False  # written already; the cache has not caught up
        patch = {"status": {"volumesInUse": list(names) or None}}
        await self.client.patch(NODES, self.node_name, patch, subresource="status")
        self._in_use_written = (names, self.clock.monotonic())
        return True

    # -- start and node shutdown ---------------------------------------------------------------------

    def restore_from_disk(self) -> None:
        """Rebuilds the actual state from vol_data.json files and the mount table (kubelet's
        reconstruction). A publish whose target is still mounted is confirmed as is (never mounted
        over again); everything else is uncertain and gets the idempotent CSI call again, or its
        inverse if no pod wants it."""
        table = mounts.read_mounts()
        for (uid, pv_name), data in self.layout.published().items():
            self.actual.mark_volume_mount_as_uncertain(mounted_from_disk(uid, pv_name, data))
            if mounts.is_mounted(str(self.layout.target_path(uid, pv_name, data.block)), table):
                self.actual.mark_volume_as_mounted(uid, pv_name)
        for key, data in self.layout.staged().items():
            if data.block or mounts.is_mounted(str(self.layout.staging_path(*key)), table):
                self.actual.mark_device_as_mounted(key)
            else:
                self.actual.mark_device_as_uncertain(key)
        log.info(
            "restored volumes from disk",
            published=len(self.actual.get_all_mounted_volumes()),
            mounted=len(self.actual.get_mounted_volume_keys()),
            staged=len(self.actual.get_possibly_mounted_devices()),
        )

    async def unmount_all(self) -> tuple[int, int]:
        """Unpublishes and unstages every volume the agent began to publish or stage, for a node
        that shuts down; returns (volumes done, volumes left). Called after the operations and the
        informers stopped, so no pass mounts anything again meanwhile.

        The records on disk say what to undo, not the in-memory state: vol_data.json is written
        before each CSI call, so it names everything the driver may hold, even when a stop came
        before `restore_from_disk` ran or cancelled an operation half-way. The API is not touched:
        the pods keep their volumes, volumesInUse and the attachments stay, and the agent's next
        start stages and publishes again for the pods still there, as kubelet does after a reboot.
        A volume whose unpublish fails keeps its staging (never unstage under a publish)."""
        staged = self.layout.staged()
        by_volume: dict[VolumeKey, list[Mounted]] = {key: [] for key in staged}
        for (uid, pv_name), data in sorted(self.layout.published().items()):
            m = mounted_from_disk(uid, pv_name, data)
            by_volume.setdefault(m.stage_key, []).append(m)
        done = await asyncio.gather(
            *(self._unmount_volume(key, pubs, key in staged) for key, pubs in sorted(by_volume.items()))
        )
        return sum(done), len(done) - sum(done)

    async def _unmount_volume(self, key: VolumeKey, publishes: list[Mounted], staged: bool) -> bool:
        # The operation limit holds here too, unstages first as in a pass: a node with hundreds of
        # volumes does not hand its plugin all of them at once while the stop timeout runs.
        async with self.operations.slots.hold(UNSTAGE):
            try:
                for m in publishes:
                    await self.generator.unpublish(m)
                if staged:
                    await self.generator.unstage(key)
            except Exception as exc:
                log.warning(
                    "volume left mounted at shutdown", driver=key[0], volume=key[1], error=error_text(exc)
                )
                return False
        return True


def mounted_from_disk(pod_uid: str, name: str, data: VolData) -> Mounted:
    """The publish a pod volume's vol_data.json records."""
    ephemeral = data.volumeLifecycleMode == "Ephemeral"
    return Mounted(pod_uid, name, data.driverName, data.volumeHandle, data.block, ephemeral=ephemeral)
