"""The volume manager, kubelet's part that mounts volumes: the desired state (the CSI volumes of
the pods on this node), the actual state (publishes and stagings begun, from vol_data.json at
start, and which of them are confirmed mounted), and a reconcile pass that runs, in kubelet's
order from the pure `decide.plan_volumes`, unpublish → stage+publish → unstage, and reports
volumesInUse before anything is mounted and until it is unstaged.

Every operation runs on one OperationExecutor keyed by (driver, volume handle): one operation per
volume at a time, each operation on it backing off on its own after a failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

from controller_runtime import mounts
from controller_runtime.attach_rules import attach_required
from controller_runtime.client import ApiClient
from controller_runtime.clock import SYSTEM_CLOCK, Clock
from controller_runtime.csi_client import error_text
from controller_runtime.events import EventRecorder
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.logs import get_logger
from controller_runtime.operations import Backoff, OperationExecutor, RetryLater
from controller_runtime.passes import CpuMeter
from controller_runtime.resources import (
    CSI_DRIVERS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import (
    bound_volume_name,
    csi_volume,
    inline_csi_volumes,
    pod_claims,
    pod_info_attributes,
    pod_terminated,
    va_name,
    volume_capability,
)
from kubeloop_grpc.csi import csi_pb2

from .decide import Mounted, PodVolume, plan_volumes
from .disk import Layout, VolData, remove_pod_dir, remove_volume_dir, write_vol_data
from .expansion import (
    FS_RESIZE_FAILED,
    VOLUME_RESIZE_FAILED,
    InUseExpansionError,
    NodeExpander,
    Target,
    pending_size,
)
from .plugins import Plugin
from .volume_stats import ClaimRef, StatsTarget

log = get_logger("node-agent")

# Operation priorities when operations wait for a slot; lower runs first. Unstaging finishes a
# volume that is already unpublished (its detach waits for nothing else), so it goes ahead of
# starting on another volume.
UNSTAGE = 0
UNPUBLISH = 1
MOUNT = 1
EXPAND = 1

VolumeKey = tuple[str, str]  # (driver, handle): what one operation at a time is held on


class NotReady(RetryLater):
    """A precondition is not met yet (not attached, plugin not registered): retried, no event."""


class VolumeManager:
    def __init__(
        self,
        client: ApiClient,
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
        self.client = client
        self.clock = clock
        self.recorder = recorder
        self.node_name = node_name
        self.layout = layout
        self.plugins = plugins
        self.csi_timeout = csi_timeout
        self.pods = SharedInformer(client, PODS, field_selector=f"spec.nodeName={node_name}")
        self.node = SharedInformer(client, NODES, field_selector=f"metadata.name={node_name}")
        self.pvs = SharedInformer(client, PERSISTENT_VOLUMES)
        self.pvcs = SharedInformer(client, PERSISTENT_VOLUME_CLAIMS)
        self.vas = SharedInformer(client, VOLUME_ATTACHMENTS)
        self.drivers = SharedInformer(client, CSI_DRIVERS)
        self.informers = (self.pods, self.node, self.pvs, self.pvcs, self.vas, self.drivers)
        # Set by informer events and finished operations: time for another pass.
        self.wake = asyncio.Event()
        # Actual state: publishes and stagings begun (from disk at start), and which are confirmed.
        self.mounted: dict[tuple[str, str], Mounted] = {}
        self.confirmed: set[tuple[str, str]] = set()
        self.staged: set[VolumeKey] = set()
        self.stage_confirmed: set[VolumeKey] = set()
        # Volume operations (stage+publish, unpublish, unstage) one per volume; at most
        # `max_concurrent_operations` at once (0 = no limit, as kubelet's operation executor), started
        # in the order queued (an unstage first: it finishes a volume), so on a busy node the first
        # pods finish first instead of every operation sharing the CPU and all finishing at the end.
        self.operations = OperationExecutor[VolumeKey](
            "node-volumes",
            backoff=backoff,
            max_concurrent=max_concurrent_operations,
            clock=clock,
            on_done=self.wake.set,
            describe_error=error_text,
            logger=log,
        )
        self._in_use_written: tuple[tuple[str, ...], float] | None = None
        self.deciding = CpuMeter()  # the CPU a pass spends deciding (paces the passes)
        self.expander = NodeExpander(client, recorder, node_name, csi_timeout)
        # Volumes whose driver can grow them only while unstaged: no online attempt until then.
        self.expand_offline_only: set[VolumeKey] = set()

    # -- start-up -----------------------------------------------------------------------------------

    def start(self) -> None:
        for inf in self.informers:
            inf.start()
        for handler_inf in (self.pods, self.node, self.vas, self.pvs, self.pvcs):
            handler_inf.add_handler(_waker(self.wake))

    async def wait_for_sync(self) -> None:
        await asyncio.gather(*(inf.wait_for_sync() for inf in self.informers))

    async def stop(self) -> None:
        await self.operations.shutdown()
        for inf in self.informers:
            await inf.stop()

    # -- node shutdown ------------------------------------------------------------------------------

    async def unmount_all(self) -> tuple[int, int]:
        """Unpublishes and unstages every volume the agent began to publish or stage, for a node
        that shuts down; returns (volumes done, volumes left). Called after `stop`, so no pass
        mounts anything again meanwhile.

        The records on disk say what to undo, not the in-memory state: vol_data.json is written
        before each CSI call, so it names everything the driver may hold, even when a stop came
        before `restore_from_disk` ran or cancelled an operation half-way. The API is not touched:
        the pods keep their volumes, volumesInUse and the attachments stay, and the agent's next
        start stages and publishes again for the pods still there, as kubelet does after a reboot.
        A volume whose unpublish fails keeps its staging (never unstage under a publish)."""
        staged = self.layout.staged()
        by_volume: dict[VolumeKey, list[Mounted]] = {key: [] for key in staged}
        for (uid, pv_name), data in sorted(self.layout.published().items()):
            m = _mounted(uid, pv_name, data)
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
                    await self._unpublish(m)
                if staged:
                    await self._unstage(key)
            except Exception as exc:
                log.warning(
                    "volume left mounted at shutdown", driver=key[0], volume=key[1], error=error_text(exc)
                )
                return False
        return True

    def restore_from_disk(self) -> None:
        """Rebuilds the actual state from vol_data.json files and the mount table. A publish whose
        target is still mounted is confirmed as is (never mounted over again); everything else is
        unconfirmed and gets the idempotent CSI call again, or its inverse if no pod wants it."""
        table = mounts.read_mounts()
        for (uid, pv_name), data in self.layout.published().items():
            m = _mounted(uid, pv_name, data)
            self.mounted[(uid, pv_name)] = m
            if mounts.is_mounted(str(self.layout.target_path(uid, pv_name, data.block)), table):
                self.confirmed.add((uid, pv_name))
        for key, data in self.layout.staged().items():
            self.staged.add(key)
            if data.block or mounts.is_mounted(str(self.layout.staging_path(*key)), table):
                self.stage_confirmed.add(key)
        log.info(
            "restored volumes from disk",
            published=len(self.mounted),
            mounted=len(self.confirmed),
            staged=len(self.staged),
        )

    def remove_orphan_pod_dirs(self) -> None:
        """Pod directories of pods that are gone and hold no volume record: left by a crash after
        the last unpublish. Directories with records are handled by the unmount path."""
        known = {p["metadata"].get("uid") for p in self.pods.store.values()}
        with_records = {uid for uid, _ in self.mounted}
        for uid in self.layout.pod_dirs():
            if uid not in known and uid not in with_records:
                remove_pod_dir(self.layout.root / "pods" / uid)

    # -- what the pod status reads ------------------------------------------------------------------

    def pod_could_have_mounted_volumes(self, pod_uid: str) -> bool:
        """Whether a publish of the pod was begun and not yet undone."""
        return any(k[0] == pod_uid for k in self.mounted)

    def all_mounted(self, volumes: list[PodVolume]) -> bool:
        return all(v.key in self.confirmed for v in volumes)

    # -- desired state ------------------------------------------------------------------------------

    def desired(self) -> tuple[list[PodVolume], dict[str, list[PodVolume]]]:
        """Volumes wanted by the pods on this node that are neither terminated nor being deleted,
        and, per pod key whose claims all resolve, its volumes (None-free: a pod with an unbound
        claim is not listed and cannot start)."""
        out: list[PodVolume] = []
        complete: dict[str, list[PodVolume]] = {}
        for pod in self.pods.store.values():
            md = pod["metadata"]
            if md.get("deletionTimestamp") or pod_terminated(pod):
                continue
            ns, uid = md.get("namespace", ""), md.get("uid", "")
            vols: list[PodVolume] = []
            resolved = True
            for _, claim, read_only in pod_claims(pod):
                pvc = self.pvcs.store.get(f"{ns}/{claim}")
                pv_name = bound_volume_name(pvc)
                pv = self.pvs.store.get(pv_name) if pv_name else None
                vol = csi_volume(pv) if pv is not None and bound_volume_name(pvc, pv) else None
                if vol is None:
                    resolved = False
                    continue
                vols.append(PodVolume(uid, f"{ns}/{md['name']}", vol, read_only or vol.read_only))
            for inline in inline_csi_volumes(pod):
                if self._pod_info_on_mount(inline.driver):
                    # kubelet's keys win over the pod's own volumeAttributes.
                    attributes = {**inline.attributes, **pod_info_attributes(pod, ephemeral=True)}
                    inline = dataclasses.replace(inline, attributes=attributes)
                vols.append(PodVolume(uid, f"{ns}/{md['name']}", inline, inline.read_only))
            out.extend(vols)
            if resolved:
                complete[f"{ns}/{md['name']}"] = vols
        return out, complete

    def _pod_info_on_mount(self, driver: str) -> bool:
        obj = self.drivers.store.get(driver)
        return obj is not None and obj.get("spec", {}).get("podInfoOnMount") is True

    def _lifecycle_modes(self, driver: str) -> list[str]:
        """The CSIDriver's volumeLifecycleModes; Persistent alone without one (kubelet's default)."""
        obj = self.drivers.store.get(driver)
        return list((obj or {}).get("spec", {}).get("volumeLifecycleModes") or ["Persistent"])

    def _attach_required(self, driver: str) -> bool:
        return attach_required(self.drivers.store.get(driver))

    # -- the reconcile pass -------------------------------------------------------------------------

    async def reconcile(self) -> dict[str, list[PodVolume]]:
        """One pass; returns, per pod key whose claims all resolve, its volumes (for pod status)."""
        with self.deciding:
            desired, complete = self.desired()
            plan = plan_volumes(desired, self.mounted, self.confirmed, self.staged)
        if await self._write_in_use(plan.in_use):
            # Operations may have finished while the write was under way: decide on the state as
            # it is now, not as it was (a stale plan would unstage or unpublish a second time).
            with self.deciding:
                desired, complete = self.desired()
                plan = plan_volumes(desired, self.mounted, self.confirmed, self.staged)
        node = self.node.store.get(self.node_name) or {}
        status = node.get("status") or {}
        in_use = set(status.get("volumesInUse") or ())
        attached = {v.get("name") for v in status.get("volumesAttached") or ()}

        ops = self.operations
        for m in plan.unmount:
            ops.run(
                m.stage_key,
                self._unpublish(m),
                operation=("unpublish", m.pod_uid, m.pv_name),
                priority=UNPUBLISH,
            )
        for pv in plan.mount:
            vol = pv.volume
            if vol.ephemeral:
                ops.run(pv.stage_key, self._mount_inline(pv), operation=("mount", *pv.key), priority=MOUNT)
                continue
            if vol.unique_name not in in_use:
                continue  # reported first, mounted after: the controller must see it in use
            if self._attach_required(vol.driver) and vol.unique_name not in attached:
                continue
            ops.run(pv.stage_key, self._mount(pv), operation=("mount", *pv.key), priority=MOUNT)
        for skey in plan.unstage:
            ops.run(skey, self._unstage(skey), operation="unstage", priority=UNSTAGE)
        for pv in self._expansions(desired):
            ops.run(pv.stage_key, self._expand(pv), operation="expand", priority=EXPAND)
        return complete

    def _expansions(self, desired: list[PodVolume]) -> list[PodVolume]:
        """One mounted publish per volume whose claim waits for the node to grow it (from the
        cache; the operation reads the claim again before acting)."""
        out: dict[VolumeKey, PodVolume] = {}
        for pv in desired:
            if (
                pv.key not in self.confirmed
                or pv.stage_key in out
                or pv.stage_key in self.expand_offline_only
            ):
                continue
            volume = self.pvs.store.get(pv.volume.pv_name)
            ref = (volume or {}).get("spec", {}).get("claimRef") or {}
            claim = self.pvcs.store.get(f"{ref.get('namespace')}/{ref.get('name')}")
            if volume is not None and claim is not None and pending_size(claim, volume) is not None:
                out[pv.stage_key] = pv
        return list(out.values())

    async def _write_in_use(self, names: tuple[str, ...]) -> bool:
        """Reports `names` as the node's volumesInUse; whether it had to write."""
        node = self.node.store.get(self.node_name)
        current = tuple(sorted((node or {}).get("status", {}).get("volumesInUse") or ()))
        if current == names:
            return False
        last = self._in_use_written
        if last is not None and last[0] == names and self.clock.monotonic() - last[1] < 2.0:
            return False  # written already; the cache has not caught up
        patch = {"status": {"volumesInUse": list(names) or None}}
        await self.client.patch(NODES, self.node_name, patch, subresource="status")
        self._in_use_written = (names, self.clock.monotonic())
        return True

    # -- volume operations --------------------------------------------------------------------------

    def stats_targets(self) -> list[StatsTarget]:
        """The confirmed publishes of claims' volumes, as kubelet's volume metrics measure them
        (inline volumes have no claim)."""
        out = []
        for key, m in self.mounted.items():
            if key not in self.confirmed or m.ephemeral:
                continue
            pv = self.pvs.store.get(m.pv_name) or {}
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

    def _plugin(self, driver: str) -> Plugin:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise NotReady(f"driver {driver} is not registered on node {self.node_name}")
        return plugin

    def _pod_object(self, pod_uid: str, pod_key: str) -> Obj:
        pod = self.pods.store.get(pod_key)
        if pod is not None:
            return pod
        ns, _, name = pod_key.partition("/")
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"namespace": ns, "name": name, "uid": pod_uid},
        }

    def _still_wanted(self, pv: PodVolume) -> bool:
        """Whether the pod still wants the volume (an operation may wait for a slot a while)."""
        pod = self.pods.store.get(pv.pod_key)
        if pod is None or pod["metadata"].get("uid", "") != pv.pod_uid:
            return False
        return not (pod["metadata"].get("deletionTimestamp") or pod_terminated(pod))

    async def _mount(self, pv: PodVolume) -> None:
        vol = pv.volume
        if pv.key not in self.mounted and not self._still_wanted(pv):
            return  # went away while queued: nothing begun, nothing to do (the next pass decides)
        plugin = self._plugin(vol.driver)
        context: dict[str, str] = {}
        if self._attach_required(vol.driver):
            va = self.vas.store.get(va_name(vol.handle, vol.driver, self.node_name))
            if va is None or not va.get("status", {}).get("attached"):
                raise NotReady(f"VolumeAttachment of {vol.pv_name} is not attached yet")
            context = dict(va["status"].get("attachmentMetadata") or {})
        cap = volume_capability(vol, plugin.single_node_multi_writer)
        staging = str(self.layout.staging_path(vol.driver, vol.handle)) if plugin.stage_unstage else ""
        pod = self._pod_object(pv.pod_uid, pv.pod_key)
        step = "MountVolume.MountDevice"
        try:
            if plugin.stage_unstage and pv.stage_key not in self.stage_confirmed:
                data = VolData(
                    vol.pv_name,
                    vol.handle,
                    vol.driver,
                    self.node_name,
                    va_name(vol.handle, vol.driver, self.node_name),
                    volumeMode="Block" if vol.block else "Filesystem",
                )
                await asyncio.to_thread(
                    write_vol_data, self.layout.staging_dir(vol.driver, vol.handle) / "vol_data.json", data
                )
                self.staged.add(pv.stage_key)
                await plugin.conn.node.NodeStageVolume(
                    csi_pb2.NodeStageVolumeRequest(
                        volume_id=vol.handle,
                        publish_context=context,
                        staging_target_path=staging,
                        volume_capability=cap,
                        volume_context=vol.attributes,
                    ),
                    timeout=self.csi_timeout,
                )
                self.stage_confirmed.add(pv.stage_key)
            step = "MapVolume.MapPodDevice" if vol.block else "MountVolume.SetUp"
            target = self.layout.target_path(pv.pod_uid, vol.pv_name, vol.block)
            if pv.key not in self.mounted:
                data = VolData(
                    vol.pv_name,
                    vol.handle,
                    vol.driver,
                    self.node_name,
                    va_name(vol.handle, vol.driver, self.node_name),
                    volumeMode="Block" if vol.block else "Filesystem",
                    podUID=pv.pod_uid,
                )
                await asyncio.to_thread(write_vol_data, target.parent / "vol_data.json", data)
                self.mounted[pv.key] = Mounted(pv.pod_uid, vol.pv_name, vol.driver, vol.handle, vol.block)
            await plugin.conn.node.NodePublishVolume(
                csi_pb2.NodePublishVolumeRequest(
                    volume_id=vol.handle,
                    publish_context=context,
                    staging_target_path=staging,
                    target_path=str(target),
                    volume_capability=cap,
                    readonly=pv.read_only,
                    volume_context=vol.attributes,
                ),
                timeout=self.csi_timeout,
            )
        except Exception as exc:
            self._failed_mount(pod, step, vol.pv_name, exc)
            raise
        self.confirmed.add(pv.key)
        # Success is logged, not recorded as an Event: kubelet dropped SuccessfulMountVolume events
        # long ago, and at 50 pods a node they would be a third of the agent's API writes.
        log.info("mounted", pod=pv.pod_key, pv=vol.pv_name, target=str(target))

    def _failed_mount(self, pod: Obj, step: str, volume: str, exc: BaseException) -> None:
        """kubelet's FailedMount event for a step that failed (not for one that only waits)."""
        if not isinstance(exc, NotReady):
            self.recorder.warning(
                pod, "FailedMount", f'{step} failed for volume "{volume}" : {error_text(exc)}'
            )

    async def _mount_inline(self, pv: PodVolume) -> None:
        """An inline `csi:` volume, as kubelet's csi plugin sets one up: the CSIDriver must allow
        Ephemeral volumes, and NodePublishVolume is the only call (no attach, no stage)."""
        vol = pv.volume
        if pv.key not in self.mounted and not self._still_wanted(pv):
            return
        pod = self._pod_object(pv.pod_uid, pv.pod_key)
        try:
            plugin = self._plugin(vol.driver)
            modes = self._lifecycle_modes(vol.driver)
            if "Ephemeral" not in modes:
                only = "[" + " ".join(f'"{m}"' for m in modes) + "]"
                raise RuntimeError(
                    f'volume mode "Ephemeral" not supported by driver {vol.driver} (only supports {only})'
                )
            target = self.layout.target_path(pv.pod_uid, vol.pv_name, False)
            if pv.key not in self.mounted:
                data = VolData(
                    vol.pv_name,
                    vol.handle,
                    vol.driver,
                    self.node_name,
                    volumeLifecycleMode="Ephemeral",
                    podUID=pv.pod_uid,
                )
                await asyncio.to_thread(write_vol_data, target.parent / "vol_data.json", data)
                self.mounted[pv.key] = Mounted(
                    pv.pod_uid, vol.pv_name, vol.driver, vol.handle, False, ephemeral=True
                )
            await plugin.conn.node.NodePublishVolume(
                csi_pb2.NodePublishVolumeRequest(
                    volume_id=vol.handle,
                    target_path=str(target),
                    volume_capability=volume_capability(vol, plugin.single_node_multi_writer),
                    readonly=pv.read_only,
                    volume_context=vol.attributes,
                ),
                timeout=self.csi_timeout,
            )
        except Exception as exc:
            self._failed_mount(pod, "MountVolume.SetUp", vol.pv_name, exc)
            raise
        self.confirmed.add(pv.key)
        log.info("mounted inline volume", pod=pv.pod_key, volume=vol.pv_name, target=str(target))

    async def _expand(self, pv: PodVolume) -> None:
        vol = pv.volume
        plugin = self._plugin(vol.driver)
        volume = self.pvs.store.get(vol.pv_name)
        if volume is None or pv.key not in self.confirmed:
            return
        ref = volume.get("spec", {}).get("claimRef") or {}
        target = Target(
            volume=vol,
            volume_path=str(self.layout.target_path(pv.pod_uid, vol.pv_name, vol.block)),
            staging_path=str(self.layout.staging_path(vol.driver, vol.handle))
            if plugin.stage_unstage
            else "",
            capability=volume_capability(vol, plugin.single_node_multi_writer),
            read_only=pv.read_only,
            pod=self._pod_object(pv.pod_uid, pv.pod_key),
        )
        try:
            await self.expander.expand(
                plugin.conn.node, target, ref.get("namespace", ""), ref.get("name", ""), volume
            )
        except InUseExpansionError as e:
            # Kubelet's "in-use expansion error": the next NodeStageVolume grows it offline.
            self.expand_offline_only.add(pv.stage_key)
            self.recorder.warning(
                target.pod,
                FS_RESIZE_FAILED,
                f'NodeExpandVolume.NodeExpandVolume failed for volume "{vol.pv_name}" : {e}',
            )
        except Exception as exc:
            self.recorder.warning(
                target.pod,
                VOLUME_RESIZE_FAILED,
                f'NodeExpandVolume.NodeExpandVolume failed for volume "{vol.pv_name}" : {error_text(exc)}',
            )
            raise

    async def _unpublish(self, m: Mounted) -> None:
        plugin = self._plugin(m.driver)
        target = self.layout.target_path(m.pod_uid, m.pv_name, m.block)
        await plugin.conn.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=m.handle, target_path=str(target)),
            timeout=self.csi_timeout,
        )
        if await asyncio.to_thread(mounts.is_mounted, str(target)):
            raise RuntimeError(f"{target} is still mounted after NodeUnpublishVolume")
        await asyncio.to_thread(remove_volume_dir, target.parent, target.name, self.layout.root / "pods")
        self.confirmed.discard((m.pod_uid, m.pv_name))
        self.mounted.pop((m.pod_uid, m.pv_name), None)
        log.info("unmounted", pod_uid=m.pod_uid, pv=m.pv_name)

    async def _unstage(self, key: tuple[str, str]) -> None:
        driver, handle = key
        if any(m.stage_key == key for m in self.mounted.values()):
            return  # never unstage under a publish (cannot happen: one operation per volume)
        plugin = self._plugin(driver)
        staging = self.layout.staging_path(driver, handle)
        # From here the staging is uncertain, as kubelet marks a device whose UnmountDevice began:
        # should the unstage fail half-way (the driver crashed after unmounting), a pod that wants
        # the volume again gets NodeStageVolume first, not a publish on a missing staging mount;
        # and that stage is the offline growth a volume waiting for one gets, so its expansion is
        # then finished like any other.
        self.stage_confirmed.discard(key)
        self.expand_offline_only.discard(key)
        if plugin.stage_unstage:
            await plugin.conn.node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                timeout=self.csi_timeout,
            )
        if await asyncio.to_thread(mounts.is_mounted, str(staging)):
            raise RuntimeError(f"{staging} is still mounted after NodeUnstageVolume")
        await asyncio.to_thread(remove_volume_dir, staging.parent, staging.name, self.layout.root / "plugins")
        self.staged.discard(key)
        log.info("unstaged", driver=driver, volume=handle)


def _mounted(pod_uid: str, name: str, data: VolData) -> Mounted:
    ephemeral = data.volumeLifecycleMode == "Ephemeral"
    return Mounted(pod_uid, name, data.driverName, data.volumeHandle, data.block, ephemeral=ephemeral)


def _waker(event: asyncio.Event) -> EventHandler:
    """A handler that only wakes the reconcile loop (business logic stays in the loop)."""
    return EventHandler(lambda _o: event.set(), lambda _o, _n: event.set(), lambda _o: event.set())
