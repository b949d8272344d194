"""The node agent: registers its Node, finds the CSI node plugin through kubelet's
plugin-registration socket, and mounts and unmounts the volumes of the pods bound to its node the
way kubelet's volume manager does (unmount, mount, unstage; volumesInUse before mounting; pod
deletion finished only after unmount), then reports those pods running.

It runs no containers: a pod is "running" once its volumes are mounted.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from controller_runtime import mounts
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.leaderelection import micro_time
from controller_runtime.logs import get_logger
from controller_runtime.resources import (
    CSI_DRIVERS,
    CSI_NODES,
    LEASES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import (
    ANN_CONTROLLER_MANAGED,
    ANN_NODE_ID,
    bound_volume_name,
    csi_volume,
    pod_claims,
    pod_terminated,
    va_name,
    volume_capability,
)
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from .disk import Layout, VolData, remove_volume_dir, write_vol_data
from .plan import Mounted, PodVolume, plan_volumes
from .slots import MOUNT, UNPUBLISH, UNSTAGE, OperationSlots

log = get_logger("node-agent")

NodeRPC = csi_pb2.NodeServiceCapability.RPC
LEASE_NAMESPACE = "kube-node-lease"


@dataclass(frozen=True)
class Options:
    loop_period: float = 0.1
    lease_duration: int = 40
    heartbeat: float = 10.0
    status_report: float = 60.0
    csi_timeout: float = 60.0
    backoff_start: float = 0.5
    backoff_max: float = 122.0
    # Volume operations (stage+publish, unpublish, unstage) running at once; 0 = no limit (kubelet's
    # operation executor has none). Always one operation per volume at a time. Waiters start in the
    # order they were queued (an unstage first: it finishes a volume), so on a busy node the first
    # pods finish first instead of every operation sharing the CPU with every other one and all of
    # them finishing together at the end.
    max_concurrent_operations: int = 8
    capacity: tuple[tuple[str, str], ...] = (("cpu", "4"), ("memory", "8Gi"), ("pods", "110"))


def _rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _message(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"rpc error: code = {exc.code().name} desc = {exc.details()}"
    return str(exc) or type(exc).__name__


class NotReady(Exception):
    """A precondition is not met yet (not attached, plugin not registered): retried, no event."""


@dataclass
class Plugin:
    name: str
    conn: CSIConnection
    node_id: str
    stage_unstage: bool
    single_node_multi_writer: bool
    topology: dict[str, str]
    max_volumes: int


class NodeAgent:
    def __init__(
        self,
        client: ApiClient,
        recorder: EventRecorder,
        node_name: str,
        root_dir: Path,
        options: Options | None = None,
    ) -> None:
        self.client = client
        self.recorder = recorder
        self.node_name = node_name
        self.layout = Layout(Path(os.path.abspath(root_dir)))
        self.options = options or Options()
        self.plugins: dict[str, Plugin] = {}
        node_selector = f"spec.nodeName={node_name}"
        self.pods = SharedInformer(client, PODS, field_selector=node_selector)
        self.node = SharedInformer(client, NODES, field_selector=f"metadata.name={node_name}")
        self.pvs = SharedInformer(client, PERSISTENT_VOLUMES)
        self.pvcs = SharedInformer(client, PERSISTENT_VOLUME_CLAIMS)
        self.vas = SharedInformer(client, VOLUME_ATTACHMENTS)
        self.drivers = SharedInformer(client, CSI_DRIVERS)
        self.informers = (self.pods, self.node, self.pvs, self.pvcs, self.vas, self.drivers)
        # Actual state: publishes and stagings begun (from disk at start), and which are confirmed.
        self.mounted: dict[tuple[str, str], Mounted] = {}
        self.confirmed: set[tuple[str, str]] = set()
        self.staged: set[tuple[str, str]] = set()
        self.stage_confirmed: set[tuple[str, str]] = set()
        self._ops: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._op_slots = OperationSlots(self.options.max_concurrent_operations)
        self._backoff: dict[object, tuple[float, float]] = {}
        self._deleting: set[str] = set()
        self._reported_running: set[str] = set()
        self._in_use_written: tuple[tuple[str, ...], float] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._wake = asyncio.Event()
        self.ready = False

    # -- node registration and heartbeat ------------------------------------------------------------

    def _conditions(self) -> list[Obj]:
        now = _rfc3339()
        conds = [
            ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
            ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
            ("PIDPressure", "False", "KubeletHasSufficientPID"),
            ("Ready", "True", "KubeletReady"),
        ]
        return [
            {"type": t, "status": s, "reason": r, "lastHeartbeatTime": now, "lastTransitionTime": now}
            for t, s, r in conds
        ]

    def _node_status(self) -> Obj:
        capacity = dict(self.options.capacity)
        return {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": self._conditions(),
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.node_name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v0.0.0-kubeloop-node-agent",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "none://0",
                "kernelVersion": os.uname().release,
                "osImage": "kubeloop",
                "kubeProxyVersion": "",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    async def register_node(self) -> None:
        labels = {
            "kubernetes.io/hostname": self.node_name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
        }
        body = {
            "metadata": {
                "name": self.node_name,
                "labels": labels,
                "annotations": {ANN_CONTROLLER_MANAGED: "true"},
            },
            "status": self._node_status(),
        }
        try:
            await self.client.create(NODES, body)
            log.info("registered node", node=self.node_name)
        except ApiError as exc:
            if not exc.conflict:
                raise
            await self.client.patch(NODES, self.node_name, {"metadata": body["metadata"]})
        await self._report_status()

    async def _report_status(self) -> None:
        status = self._node_status()
        await self.client.patch(NODES, self.node_name, {"status": status}, subresource="status")

    async def _renew_lease(self) -> None:
        spec = {
            "holderIdentity": self.node_name,
            "leaseDurationSeconds": self.options.lease_duration,
            "renewTime": micro_time(),
        }
        try:
            await self.client.patch(LEASES, self.node_name, {"spec": spec}, namespace=LEASE_NAMESPACE)
        except ApiError as exc:
            if not exc.not_found:
                raise
            node = await self.client.get(NODES, self.node_name)
            owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node_name,
                "uid": node["metadata"]["uid"],
            }
            body = {
                "metadata": {
                    "name": self.node_name,
                    "namespace": LEASE_NAMESPACE,
                    "ownerReferences": [owner],
                },
                "spec": spec,
            }
            await self.client.create(LEASES, body)

    async def _heartbeat(self) -> None:
        last_status = time.monotonic()
        while True:
            try:
                await self._renew_lease()
                if time.monotonic() - last_status >= self.options.status_report:
                    await self._report_status()
                    last_status = time.monotonic()
            except Exception as exc:
                log.warning("node heartbeat failed", error=str(exc))
            await asyncio.sleep(self.options.heartbeat)

    # -- plugin registration ------------------------------------------------------------------------

    async def discover_plugins(self) -> None:
        """Asks every `*-reg.sock` in plugins_registry for its CSI endpoint, connects, reads
        NodeGetInfo and records the driver in CSINode and the node's annotation and labels."""
        registry = self.layout.plugins_registry()
        for sock in sorted(registry.glob("*-reg.sock")) if registry.is_dir() else []:
            try:
                await self._register_plugin(sock)
            except Exception as exc:
                log.warning("plugin registration failed", socket=str(sock), error=_message(exc))

    async def _register_plugin(self, sock: Path) -> None:
        async with grpc.aio.insecure_channel(f"unix:{sock}") as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            info = await stub.GetInfo(api_pb2.InfoRequest(), timeout=5)
            if info.type != "CSIPlugin" or info.name in self.plugins:
                return
            try:
                plugin = await self._connect(info.name, info.endpoint)
                await self._write_csinode(plugin)
            except Exception as exc:
                await stub.NotifyRegistrationStatus(
                    api_pb2.RegistrationStatus(plugin_registered=False, error=_message(exc)), timeout=5
                )
                raise
            await stub.NotifyRegistrationStatus(api_pb2.RegistrationStatus(plugin_registered=True), timeout=5)
        self.plugins[plugin.name] = plugin
        log.info("registered CSI plugin", driver=plugin.name, endpoint=info.endpoint, node_id=plugin.node_id)

    async def _connect(self, name: str, endpoint: str) -> Plugin:
        conn = await CSIConnection.connect(endpoint, timeout=self.options.csi_timeout, wait=30)
        try:
            info = await conn.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest(), timeout=10)
            caps = await conn.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest(), timeout=10)
        except BaseException:
            await conn.close()
            raise
        rpcs = {c.rpc.type for c in caps.capabilities if c.HasField("rpc")}
        topology = dict(info.accessible_topology.segments) if info.HasField("accessible_topology") else {}
        return Plugin(
            name=name,
            conn=conn,
            node_id=info.node_id,
            stage_unstage=NodeRPC.STAGE_UNSTAGE_VOLUME in rpcs,
            single_node_multi_writer=NodeRPC.SINGLE_NODE_MULTI_WRITER in rpcs,
            topology=topology,
            max_volumes=int(info.max_volumes_per_node),
        )

    async def _write_csinode(self, plugin: Plugin) -> None:
        segments = plugin.topology
        node = await self.client.get(NODES, self.node_name)
        ids = json.loads((node["metadata"].get("annotations") or {}).get(ANN_NODE_ID) or "{}")
        ids[plugin.name] = plugin.node_id
        await self.client.patch(
            NODES,
            self.node_name,
            {"metadata": {"annotations": {ANN_NODE_ID: json.dumps(ids, sort_keys=True)}, "labels": segments}},
        )
        entry: Obj = {"name": plugin.name, "nodeID": plugin.node_id, "topologyKeys": sorted(segments) or None}
        if plugin.max_volumes > 0:
            entry["allocatable"] = {"count": plugin.max_volumes}
        owner = {"apiVersion": "v1", "kind": "Node", "name": self.node_name, "uid": node["metadata"]["uid"]}
        for _ in range(5):
            try:
                current = await self.client.get(CSI_NODES, self.node_name)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                body = {
                    "metadata": {"name": self.node_name, "ownerReferences": [owner]},
                    "spec": {"drivers": [entry]},
                }
                try:
                    await self.client.create(CSI_NODES, body)
                    return
                except ApiError as create_exc:
                    if create_exc.conflict:
                        continue
                    raise
            fresh = copy.deepcopy(current)
            drivers = [d for d in fresh["spec"].get("drivers") or [] if d.get("name") != plugin.name]
            fresh["spec"]["drivers"] = [*drivers, entry]
            try:
                await self.client.update(CSI_NODES, fresh)
                return
            except ApiError as exc:
                if not exc.conflict:
                    raise
        raise RuntimeError("CSINode kept changing under us")

    # -- start-up -----------------------------------------------------------------------------------

    def restore_from_disk(self) -> None:
        """Rebuilds the actual state from vol_data.json files and the mount table. A publish whose
        target is still mounted is confirmed as is (never mounted over again); everything else is
        unconfirmed and gets the idempotent CSI call again, or its inverse if no pod wants it."""
        table = mounts.read_mounts()
        for (uid, pv_name), data in self.layout.published().items():
            m = Mounted(uid, pv_name, data.driverName, data.volumeHandle, data.block)
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

    async def run(self) -> None:
        await self.register_node()
        self._tasks.append(asyncio.create_task(self._heartbeat(), name="heartbeat"))
        while not self.plugins:
            await self.discover_plugins()
            if not self.plugins:
                await asyncio.sleep(0.5)
        self._tasks.append(asyncio.create_task(self._rediscover(), name="plugin-watch"))
        for inf in self.informers:
            inf.start()
        for handler_inf in (self.pods, self.node, self.vas):
            handler_inf.add_handler(_waker(self._wake))
        await asyncio.gather(*(inf.wait_for_sync() for inf in self.informers))
        self.restore_from_disk()
        await asyncio.to_thread(self._remove_orphan_pod_dirs)
        self.ready = True
        log.info("node agent ready", node=self.node_name, plugins=",".join(self.plugins))
        try:
            while True:
                self._wake.clear()
                try:
                    await self.reconcile()
                except Exception:
                    log.exception("reconcile pass failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.options.loop_period)
                await asyncio.sleep(self.options.loop_period / 10)
        finally:
            ops = list(self._ops.values())
            for t in [*ops, *self._tasks]:
                t.cancel()
            await asyncio.gather(*ops, *self._tasks, return_exceptions=True)
            for inf in self.informers:
                await inf.stop()
            for plugin in self.plugins.values():
                await plugin.conn.close()

    def _remove_orphan_pod_dirs(self) -> None:
        """Pod directories of pods that are gone and hold no volume record: left by a crash after
        the last unpublish. Directories with records are handled by the unmount path."""
        known = {p["metadata"].get("uid") for p in self.pods.store.values()}
        with_records = {uid for uid, _ in self.mounted}
        for uid in self.layout.pod_dirs():
            if uid not in known and uid not in with_records:
                _remove_pod_dir(self.layout.root / "pods" / uid)

    async def _rediscover(self) -> None:
        while True:
            await asyncio.sleep(10)
            await self.discover_plugins()

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
            out.extend(vols)
            if resolved:
                complete[f"{ns}/{md['name']}"] = vols
        return out, complete

    def _attach_required(self, driver: str) -> bool:
        obj = self.drivers.store.get(driver)
        return obj is None or obj.get("spec", {}).get("attachRequired", True) is not False

    # -- the reconcile pass -------------------------------------------------------------------------

    def _busy(self, key: tuple[str, str], backoff_key: object, now: float) -> bool:
        if key in self._ops:
            return True
        retry = self._backoff.get(backoff_key)
        return retry is not None and now < retry[0]

    def _spawn(
        self,
        key: tuple[str, str],
        backoff_key: object,
        coro: Coroutine[Any, Any, None],
        priority: int = MOUNT,
    ) -> None:
        async def op() -> None:
            try:
                async with self._op_slots.hold(priority):
                    await coro
            except NotReady as exc:
                log.debug("waiting", volume=key[1], reason=str(exc))
                self._backoff[backoff_key] = (time.monotonic() + 0.5, 0.0)
            except Exception as exc:
                _, last = self._backoff.get(backoff_key, (0.0, 0.0))
                delay = min(self.options.backoff_max, max(self.options.backoff_start, last * 2))
                self._backoff[backoff_key] = (time.monotonic() + delay, delay)
                log.warning(
                    "volume operation failed", volume=key[1], retry_in=f"{delay:.1f}s", error=_message(exc)
                )
            else:
                self._backoff.pop(backoff_key, None)
            finally:
                self._ops.pop(key, None)
                self._wake.set()

        self._ops[key] = asyncio.create_task(op())

    async def reconcile(self) -> None:
        now = time.monotonic()
        desired, complete = self.desired()
        plan = plan_volumes(desired, self.mounted, self.confirmed, self.staged)
        if await self._write_in_use(plan.in_use):
            # Operations may have finished while the write was under way: decide on the state as
            # it is now, not as it was (a stale plan would unstage or unpublish a second time).
            now = time.monotonic()
            desired, complete = self.desired()
            plan = plan_volumes(desired, self.mounted, self.confirmed, self.staged)
        node = self.node.store.get(self.node_name) or {}
        status = node.get("status") or {}
        in_use = set(status.get("volumesInUse") or ())
        attached = {v.get("name") for v in status.get("volumesAttached") or ()}

        for m in plan.unmount:
            key = m.stage_key
            if not self._busy(key, ("unpublish", m.pod_uid, m.pv_name), now):
                self._spawn(key, ("unpublish", m.pod_uid, m.pv_name), self._unpublish(m), UNPUBLISH)
        for pv in plan.mount:
            vol = pv.volume
            if vol.unique_name not in in_use:
                continue  # reported first, mounted after: the controller must see it in use
            if self._attach_required(vol.driver) and vol.unique_name not in attached:
                continue
            if not self._busy(pv.stage_key, ("mount", *pv.key), now):
                self._spawn(pv.stage_key, ("mount", *pv.key), self._mount(pv), MOUNT)
        for skey in plan.unstage:
            if not self._busy(skey, ("unstage", *skey), now):
                self._spawn(skey, ("unstage", *skey), self._unstage(skey), UNSTAGE)
        await self._pod_statuses(complete)

    async def _write_in_use(self, names: tuple[str, ...]) -> bool:
        """Reports `names` as the node's volumesInUse; whether it had to write."""
        node = self.node.store.get(self.node_name)
        current = tuple(sorted((node or {}).get("status", {}).get("volumesInUse") or ()))
        if current == names:
            return False
        last = self._in_use_written
        if last is not None and last[0] == names and time.monotonic() - last[1] < 2.0:
            return False  # written already; the cache has not caught up
        patch = {"status": {"volumesInUse": list(names) or None}}
        await self.client.patch(NODES, self.node_name, patch, subresource="status")
        self._in_use_written = (names, time.monotonic())
        return True

    # -- volume operations --------------------------------------------------------------------------

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
                    timeout=self.options.csi_timeout,
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
                timeout=self.options.csi_timeout,
            )
        except Exception as exc:
            if not isinstance(exc, NotReady):
                self.recorder.warning(
                    pod, "FailedMount", f'{step} failed for volume "{vol.pv_name}" : {_message(exc)}'
                )
            raise
        self.confirmed.add(pv.key)
        # Success is logged, not recorded as an Event: kubelet dropped SuccessfulMountVolume events
        # long ago, and at 50 pods a node they would be a third of the agent's API writes.
        log.info("mounted", pod=pv.pod_key, pv=vol.pv_name, target=str(target))

    async def _unpublish(self, m: Mounted) -> None:
        plugin = self._plugin(m.driver)
        target = self.layout.target_path(m.pod_uid, m.pv_name, m.block)
        await plugin.conn.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=m.handle, target_path=str(target)),
            timeout=self.options.csi_timeout,
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
        if plugin.stage_unstage:
            await plugin.conn.node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=handle, staging_target_path=str(staging)),
                timeout=self.options.csi_timeout,
            )
        if await asyncio.to_thread(mounts.is_mounted, str(staging)):
            raise RuntimeError(f"{staging} is still mounted after NodeUnstageVolume")
        await asyncio.to_thread(remove_volume_dir, staging.parent, staging.name, self.layout.root / "plugins")
        self.stage_confirmed.discard(key)
        self.staged.discard(key)
        log.info("unstaged", driver=driver, volume=handle)

    # -- pods ---------------------------------------------------------------------------------------

    async def _pod_statuses(self, complete: dict[str, list[PodVolume]]) -> None:
        writes = []
        for pod in self.pods.store.values():
            md = pod["metadata"]
            key, uid = f"{md.get('namespace', '')}/{md['name']}", md.get("uid", "")
            if md.get("deletionTimestamp"):
                busy = any(k[0] == uid for k in self.mounted)
                if not busy and uid not in self._deleting:
                    self._deleting.add(uid)
                    writes.append(self._finish_deletion(pod))
                continue
            vols = complete.get(key)
            if vols is None or pod_terminated(pod) or uid in self._reported_running:
                continue
            if all(v.key in self.confirmed for v in vols):
                self._reported_running.add(uid)
                writes.append(self._set_running(pod))
        if writes:
            await asyncio.gather(*writes)

    async def _set_running(self, pod: Obj) -> None:
        md = pod["metadata"]
        status = pod.get("status") or {}
        if status.get("phase") == "Running" and any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        ):
            return
        now = _rfc3339()
        conditions = [
            {"type": t, "status": "True", "lastTransitionTime": now}
            for t in ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")
        ]
        containers = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "containerID": f"kubeloop://{md.get('uid', '')}/{c['name']}",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in pod.get("spec", {}).get("containers") or []
        ]
        patch = {
            "status": {
                "phase": "Running",
                "conditions": conditions,
                "hostIP": "127.0.0.1",
                "hostIPs": [{"ip": "127.0.0.1"}],
                "podIP": "127.0.0.1",
                "podIPs": [{"ip": "127.0.0.1"}],
                "startTime": status.get("startTime") or now,
                "containerStatuses": containers,
            }
        }
        try:
            await self.client.patch(
                PODS, md["name"], patch, namespace=md.get("namespace"), subresource="status"
            )
            log.info("pod running", pod=f"{md.get('namespace')}/{md['name']}")
        except ApiError as exc:
            self._reported_running.discard(md.get("uid", ""))
            if not exc.not_found:
                log.warning("could not update pod status", pod=md["name"], error=str(exc))

    async def _finish_deletion(self, pod: Obj) -> None:
        """Deletes the pod for good (grace period 0) once nothing of it is mounted, as kubelet does
        after its containers stopped and volumes were torn down."""
        md = pod["metadata"]
        body = {
            "kind": "DeleteOptions",
            "apiVersion": "v1",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": md.get("uid", "")},
        }
        try:
            await self.client.request("DELETE", PODS.path(md.get("namespace"), md["name"]), body=body)
            log.info("pod deleted", pod=f"{md.get('namespace')}/{md['name']}")
        except ApiError as exc:
            if not (exc.not_found or exc.conflict):
                self._deleting.discard(md.get("uid", ""))
                log.warning("could not delete pod", pod=md["name"], error=str(exc))
        await asyncio.to_thread(_remove_pod_dir, self.layout.root / "pods" / md.get("uid", "x"))


def _remove_pod_dir(path: Path) -> None:
    """Removes a pod's directory tree bottom-up if it only holds empty directories."""
    if not path.is_dir():
        return
    for dirpath, _dirnames, _files in sorted(os.walk(path), key=lambda e: -len(e[0])):
        with contextlib.suppress(OSError):
            os.rmdir(dirpath)


def _waker(event: asyncio.Event) -> EventHandler:
    """A handler that only wakes the reconcile loop (business logic stays in the loop)."""
    return EventHandler(lambda _o: event.set(), lambda _o, _n: event.set(), lambda _o: event.set())
