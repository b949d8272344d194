"""The node agent's volume operations (kubelet's operation generator,
pkg/volume/util/operationexecutor): stage+publish, publish of an inline volume, node expansion,
unpublish and unstage, each through the CSI node plugin, each recording in the actual state what
it began and what it finished.

Which operation runs, and when, is the reconciler's to say; an operation only checks what may have
changed while it waited for its turn (the pod went away, the attachment is not there yet).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from controller_runtime import mounts
from controller_runtime.attach_rules import attach_required
from controller_runtime.csi_client import error_text
from controller_runtime.events import EventRecorder
from controller_runtime.kinds import csi_driver_view, pod_view, pv_view, volume_attachment_view
from controller_runtime.logs import get_logger
from controller_runtime.operations import RetryLater
from controller_runtime.resources import Obj
from controller_runtime.store import Store
from controller_runtime.volumes import CSIVolume, pod_terminated, va_name, volume_capability
from kubeloop_grpc.csi import csi_pb2

from .actual_state import ActualStateOfWorld, DeviceMountState, VolumeKey, VolumeMountState
from .decide import Mounted, PodVolume
from .disk import Layout, VolData, remove_volume_dir, write_vol_data
from .expansion import FS_RESIZE_FAILED, VOLUME_RESIZE_FAILED, InUseExpansionError, NodeExpander, Target
from .plugins import Plugin

log = get_logger("node-agent")


class NotReady(RetryLater):
    """A precondition is not met yet (not attached, plugin not registered): retried, no event."""


class OperationGenerator:
    def __init__(
        self,
        actual: ActualStateOfWorld,
        recorder: EventRecorder,
        expander: NodeExpander,
        node_name: str,
        layout: Layout,
        plugins: Mapping[str, Plugin],
        *,
        pods: Store,
        volumes: Store,
        attachments: Store,
        drivers: Store,
        csi_timeout: float,
    ) -> None:
        self.actual = actual
        self.recorder = recorder
        self.expander = expander
        self.node_name = node_name
        self.layout = layout
        self.plugins = plugins
        self.pods = pods
        self.volumes = volumes
        self.attachments = attachments
        self.drivers = drivers
        self.csi_timeout = csi_timeout

    def attach_required(self, driver: str) -> bool:
        return attach_required(csi_driver_view(self.drivers.get(driver)))

    def _lifecycle_modes(self, driver: str) -> list[str]:
        """The CSIDriver's volumeLifecycleModes; Persistent alone without one (kubelet's default)."""
        csidriver = csi_driver_view(self.drivers.get(driver))
        return list((csidriver or {}).get("spec", {}).get("volumeLifecycleModes") or ["Persistent"])

    def _plugin(self, driver: str) -> Plugin:
        plugin = self.plugins.get(driver)
        if plugin is None:
            raise NotReady(f"driver {driver} is not registered on node {self.node_name}")
        return plugin

    def _pod_object(self, pod_uid: str, pod_key: str) -> Obj:
        pod = self.pods.get(pod_key)
        if pod is not None:
            return pod
        ns, _, name = pod_key.partition("/")
        return {
            "kind": "Pod",
            "apiVersion": "v1",
            "metadata": {"namespace": ns, "name": name, "uid": pod_uid},
        }

    def still_wanted(self, pv: PodVolume) -> bool:
        """Whether the pod still wants the volume (an operation may wait for a slot a while)."""
        pod = pod_view(self.pods.get(pv.pod_key))
        if pod is None or pod["metadata"].get("uid", "") != pv.pod_uid:
            return False
        return not (pod["metadata"].get("deletionTimestamp") or pod_terminated(pod))

    def _begun(self, pv: PodVolume) -> bool:
        return (
            self.actual.get_volume_mount_state(pv.pod_uid, pv.volume.pv_name)
            is not VolumeMountState.NOT_MOUNTED
        )

    def _vol_data(self, vol: CSIVolume, pod_uid: str = "") -> VolData:
        return VolData(
            vol.pv_name,
            vol.handle,
            vol.driver,
            self.node_name,
            va_name(vol.handle, vol.driver, self.node_name),
            volumeMode="Block" if vol.block else "Filesystem",
            podUID=pod_uid,
        )

    async def mount(self, pv: PodVolume) -> None:
        vol = pv.volume
        if not self._begun(pv) and not self.still_wanted(pv):
            return  # went away while queued: nothing begun, nothing to do (the next pass decides)
        plugin = self._plugin(vol.driver)
        context: dict[str, str] = {}
        if self.attach_required(vol.driver):
            va = volume_attachment_view(self.attachments.get(va_name(vol.handle, vol.driver, self.node_name)))
            if va is None or not va.get("status", {}).get("attached"):
                raise NotReady(f"VolumeAttachment of {vol.pv_name} is not attached yet")
            context = dict(va["status"].get("attachmentMetadata") or {})
        cap = volume_capability(vol, plugin.single_node_multi_writer)
        staging = str(self.layout.staging_path(vol.driver, vol.handle)) if plugin.stage_unstage else ""
        pod = self._pod_object(pv.pod_uid, pv.pod_key)
        step = "MountVolume.MountDevice"
        try:
            device = self.actual.get_device_mount_state(pv.stage_key)
            if plugin.stage_unstage and device is not DeviceMountState.GLOBALLY_MOUNTED:
                await asyncio.to_thread(
                    write_vol_data,
                    self.layout.staging_dir(vol.driver, vol.handle) / "vol_data.json",
                    self._vol_data(vol),
                )
                # kubelet makes the staging directory itself (csi_attacher's MountDevice; the CSI
                # spec has the CO ensure it is a directory): kubeloop's driver would make a missing
                # one, others answer the bind mount's ENOENT.
                await asyncio.to_thread(Path(staging).mkdir, 0o750, exist_ok=True)
                self.actual.mark_device_as_uncertain(pv.stage_key)
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
                self.actual.mark_device_as_mounted(pv.stage_key)
            step = "MapVolume.MapPodDevice" if vol.block else "MountVolume.SetUp"
            target = self.layout.target_path(pv.pod_uid, vol.pv_name, vol.block)
            if not self._begun(pv):
                data = self._vol_data(vol, pv.pod_uid)
                await asyncio.to_thread(write_vol_data, target.parent / "vol_data.json", data)
                self.actual.mark_volume_mount_as_uncertain(
                    Mounted(pv.pod_uid, vol.pv_name, vol.driver, vol.handle, vol.block)
                )
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
        self.actual.mark_volume_as_mounted(pv.pod_uid, vol.pv_name)
        # Success is logged, not recorded as an Event: kubelet dropped SuccessfulMountVolume events
        # long ago, and at 50 pods a node they would be a third of the agent's API writes.
        log.info("mounted", pod=pv.pod_key, pv=vol.pv_name, target=str(target))

    def _failed_mount(self, pod: Obj, step: str, volume: str, exc: BaseException) -> None:
        """kubelet's FailedMount event for a step that failed (not for one that only waits)."""
        if not isinstance(exc, NotReady):
            self.recorder.warning(
                pod, "FailedMount", f'{step} failed for volume "{volume}" : {error_text(exc)}'
            )

    async def mount_inline(self, pv: PodVolume) -> None:
        """An inline `csi:` volume, as kubelet's csi plugin sets one up: the CSIDriver must allow
        Ephemeral volumes, and NodePublishVolume is the only call (no attach, no stage)."""
        vol = pv.volume
        if not self._begun(pv) and not self.still_wanted(pv):
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
            if not self._begun(pv):
                data = VolData(
                    vol.pv_name,
                    vol.handle,
                    vol.driver,
                    self.node_name,
                    volumeLifecycleMode="Ephemeral",
                    podUID=pv.pod_uid,
                )
                await asyncio.to_thread(write_vol_data, target.parent / "vol_data.json", data)
                self.actual.mark_volume_mount_as_uncertain(
                    Mounted(pv.pod_uid, vol.pv_name, vol.driver, vol.handle, False, ephemeral=True)
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
        self.actual.mark_volume_as_mounted(pv.pod_uid, vol.pv_name)
        log.info("mounted inline volume", pod=pv.pod_key, volume=vol.pv_name, target=str(target))

    async def expand(self, pv: PodVolume) -> None:
        vol = pv.volume
        plugin = self._plugin(vol.driver)
        volume = pv_view(self.volumes.get(vol.pv_name))
        if volume is None or not self.actual.pod_exists_in_volume(pv.pod_uid, vol.pv_name):
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
            self.actual.mark_for_in_use_expansion_error(pv.stage_key)
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

    async def unpublish(self, m: Mounted) -> None:
        plugin = self._plugin(m.driver)
        target = self.layout.target_path(m.pod_uid, m.pv_name, m.block)
        await plugin.conn.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=m.handle, target_path=str(target)),
            timeout=self.csi_timeout,
        )
        if await asyncio.to_thread(mounts.is_mounted, str(target)):
            raise RuntimeError(f"{target} is still mounted after NodeUnpublishVolume")
        await asyncio.to_thread(remove_volume_dir, target.parent, target.name, self.layout.root / "pods")
        self.actual.mark_volume_as_unmounted(m.pod_uid, m.pv_name)
        log.info("unmounted", pod_uid=m.pod_uid, pv=m.pv_name)

    async def unstage(self, key: VolumeKey) -> None:
        driver, handle = key
        if self.actual.volume_published_for_any_pod(key):
            return  # never unstage under a publish (cannot happen: one operation per volume)
        plugin = self._plugin(driver)
        staging = self.layout.staging_path(driver, handle)
        # From here the staging is uncertain, as kubelet marks a device whose UnmountDevice began:
        # should the unstage fail half-way (the driver crashed after unmounting), a pod that wants
        # the volume again gets NodeStageVolume first, not a publish on a missing staging mount;
        # and that stage is the offline growth a volume waiting for one gets, so its expansion is
        # then finished like any other.
        self.actual.mark_device_as_uncertain(key)
        self.actual.clear_in_use_expansion_error(key)
        if plugin.stage_unstage:
            await plugin.conn.node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                timeout=self.csi_timeout,
            )
        if await asyncio.to_thread(mounts.is_mounted, str(staging)):
            raise RuntimeError(f"{staging} is still mounted after NodeUnstageVolume")
        await asyncio.to_thread(remove_volume_dir, staging.parent, staging.name, self.layout.root / "plugins")
        self.actual.mark_device_as_unmounted(key)
        log.info("unstaged", driver=driver, volume=handle)
