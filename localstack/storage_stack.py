"""The storage half of the stack for e2e tests: the make-up registry's kubeloop processes (the real
CSI driver in controller mode and one node plugin per node, pv-controller, external-attacher,
attach-detach controller, one node agent per node) started as separate processes against the
session's control plane, each under its own ServiceAccount identity and RBAC. With
`pools=NODE_LOCAL` they are the node-local registry's instead (each node its own pool, plugin,
provisioner and resizer; docs/local-stack.md), and the CSIDriver says attachRequired: false.

Helpers create volumes straight through the driver's CreateVolume and pre-bind static PVs to
claims (the pv-controller completes the binds); the Immediate class of the dynamic provisioner pins
a volume to one node, which would forbid moving a claim between nodes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.resources import (
    CSI_DRIVERS,
    CSI_NODES,
    CSI_STORAGE_CAPACITIES,
    EVENTS,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.resources import NODES as NODE_OBJECTS
from controller_runtime.volumes import va_name
from csi_driver import DRIVER_NAME
from external_provisioner.names import CAPACITY_LABEL_DRIVER
from kubeloop_grpc.csi import csi_pb2
from localstack.components import Component, ComponentContext, Components, Instance, registry
from localstack.controlplane import ControlPlane
from localstack.leftovers import force_cleanup, loop_backing_files, mounts_under
from localstack.pools import SHARED, PoolCapacity, PoolMode, csidriver_spec, node_pool_dir, shared_pool_dir
from localstack.proc import ManagedProcess, RestartPolicy, free_ports

NODES = ("node-a", "node-b")
STORAGE_COMPONENTS = (
    "pv-controller",
    "csi-driver-controller",
    "csi-driver-node",
    "node-agent",
    "external-attacher",
    "attach-detach-controller",
)
Mode = csi_pb2.VolumeCapability.AccessMode.Mode
CAPACITY_NAMESPACE = "kube-system"  # where the stack's provisioners publish (their --capacity-namespace)


def require_root() -> None:
    # Never skipped: these tests are the attach/mount path end to end, on real loop devices.
    assert os.geteuid() == 0, "the attach/mount e2e tests need root (loop devices, mount)"
    assert os.path.exists("/dev/loop-control"), "the attach/mount e2e tests need /dev/loop-control"


class ShortHomeComponents(Components):
    """Components whose files live under a short home: unix socket paths are limited to 107 bytes
    and pytest's temporary directories are long."""

    def __init__(
        self,
        cp: ControlPlane,
        components: list[Component],
        home: Path,
        restart: RestartPolicy | None = None,
        *,
        pools: PoolMode = SHARED,
        pool_capacity: PoolCapacity | None = None,
    ) -> None:
        super().__init__(
            cp,
            components,
            NODES,
            on_unexpected_exit=lambda _p, _c: None,
            restart=restart,
            pools=pools,
            pool_capacity=pool_capacity,
        )
        self.short_home = home

    def context(self, inst: Instance) -> ComponentContext:
        ctx = super().context(inst)
        return dataclasses.replace(
            ctx, home=self.short_home, state_dir=self.short_home / "components" / inst.name
        )


def storage_components(
    names: tuple[str, ...] = STORAGE_COMPONENTS, pools: PoolMode = SHARED
) -> list[Component]:
    """The registry's entries by name, each on free ports."""
    by_name = {c.name: c for c in registry(pools)}
    out = []
    for name in names:
        comp = by_name[name]
        # A per-node component's instance i listens on port + i: it needs a block of free ports.
        port = free_ports(len(NODES), consecutive=True)[0] if comp.per_node else free_ports(1)[0]
        out.append(dataclasses.replace(comp, http_port=port))
    return out


class StorageStack:
    """`restart`: supervise the processes as `make up` does (restarted with backoff after a crash);
    without it a crashed process stays down until a test starts it (kill9). `pools` and
    `pool_capacity` as `make up --pools --pool-capacity`; `names` are then that mode's registry's."""

    def __init__(
        self,
        cp: ControlPlane,
        api: ApiClient,
        names: tuple[str, ...] = STORAGE_COMPONENTS,
        *,
        restart: RestartPolicy | None = None,
        components: list[Component] | None = None,
        pools: PoolMode = SHARED,
        pool_capacity: PoolCapacity | None = None,
    ) -> None:
        self.cp = cp
        self.api = api
        self.pools = pools
        self.home = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
        chosen = components if components is not None else storage_components(names, pools)
        self.components = ShortHomeComponents(
            cp, chosen, self.home, restart, pools=pools, pool_capacity=pool_capacity
        )
        self.csi: CSIConnection | None = None

    @property
    def pool(self) -> Path:
        """The shared pool (`pools=SHARED`)."""
        return shared_pool_dir(self.home)

    def node_pool(self, node: str) -> Path:
        """A node's own pool (`pools=NODE_LOCAL`)."""
        return node_pool_dir(self.home, node)

    def pools_dirs(self) -> list[Path]:
        return [self.pool] if self.pools == SHARED else [self.node_pool(n) for n in NODES]

    def kubelet_root(self, node: str) -> Path:
        return self.home / "nodes" / node / "kubelet"

    def process(self, name: str) -> ManagedProcess:
        return self.components.processes[name]

    async def start(self) -> None:
        require_root()
        await self._csidriver()
        await self.components.start()
        if self.pools == SHARED:  # node-local has no controller plugin of its own
            sock = self.home / "components" / "csi-driver-controller" / "csi.sock"
            self.csi = await CSIConnection.connect(f"unix://{sock}", timeout=30, wait=30)

    async def _csidriver(self) -> None:
        """The CSIDriver this mode needs. The session's control plane serves every e2e module, in
        either mode (and some modules make a CSIDriver of their own), and attachRequired and
        volumeLifecycleModes cannot be changed: one that differs is replaced."""
        spec = csidriver_spec(self.pools)
        try:
            current = await self.api.get(CSI_DRIVERS, DRIVER_NAME)
        except ApiError as exc:
            if not exc.not_found:
                raise
        else:
            if all(current["spec"].get(key) == value for key, value in spec.items()):
                return
            await self.api.delete(CSI_DRIVERS, DRIVER_NAME)
            await wait_for(lambda: _gone(self.api, CSI_DRIVERS, DRIVER_NAME), 30, "the old CSIDriver gone")
        await self.api.create(CSI_DRIVERS, {"metadata": {"name": DRIVER_NAME}, "spec": spec})

    async def stop(self) -> None:
        if self.csi is not None:
            await self.csi.close()
        await self.components.stop()
        force_cleanup(self.home)
        shutil.rmtree(self.home, ignore_errors=True)
        # The session's control plane outlives this stack: its Ready nodes must not attract other
        # tests' pods, nor their CSINodes other tests' capacity or topology.
        for node in NODES:
            for res in (CSI_NODES, NODE_OBJECTS):
                try:
                    if res is NODE_OBJECTS:
                        # The node finalizer (node-local) has stopped: its finalizer would keep the
                        # Node, and the next stack's node agent would find it terminating.
                        await self.api.patch(NODE_OBJECTS, node, {"metadata": {"finalizers": None}})
                    await self.api.delete(res, node)
                except ApiError as exc:
                    if not exc.not_found:
                        raise
        # Nor its CSIDriver another test's scheduling: with storageCapacity the scheduler places a
        # WaitForFirstConsumer claim of the driver only where a CSIStorageCapacity admits it, and a
        # later test's own class has none (its pod stayed Pending).
        try:
            await self.api.delete(CSI_DRIVERS, DRIVER_NAME)
        except ApiError as exc:
            if not exc.not_found:
                raise
        # Nor the CSIStorageCapacity objects its provisioners published: they have no owner here
        # (--capacity-ownerref-level=-1), and a later stack's scheduler would place pods by them.
        published = f"{CAPACITY_LABEL_DRIVER}={DRIVER_NAME}"
        items, _ = await self.api.list_all(
            CSI_STORAGE_CAPACITIES, CAPACITY_NAMESPACE, labelSelector=published
        )
        for item in items:
            try:
                await self.api.delete(CSI_STORAGE_CAPACITIES, item["metadata"]["name"], CAPACITY_NAMESPACE)
            except ApiError as exc:
                if not exc.not_found:
                    raise

    async def kill9(self, name: str, restart: bool = True) -> None:
        """SIGKILL to the process group, as a crash, then (unless told not to) start it again; a
        supervised stack's process is restarted by its supervisor, and this waits for that."""
        proc = self.process(name)
        assert proc.pid is not None
        with_group = proc.pid
        restarts = proc.restarts
        os.killpg(with_group, signal.SIGKILL)
        if proc.restart is not None:
            await wait_for(lambda: _restarted(proc, restarts), 60, f"{name} restarted by its supervisor")
            return
        for _ in range(100):
            if not proc.running:
                break
            await asyncio.sleep(0.05)
        if restart:
            await proc.start()

    # -- volumes ------------------------------------------------------------------------------------

    async def volume(
        self,
        namespace: str,
        *,
        modes: tuple[str, ...] = ("ReadWriteOnce",),
        block: bool = False,
        size_mi: int = 64,
        fs_type: str = "ext4",
        class_name: str = "",
    ) -> tuple[str, str, str]:
        """A driver volume, a static PV for it pre-bound to a new claim; returns (pvc, pv, handle).
        A `class_name` whose class allows expansion makes the claim expandable."""
        assert self.csi is not None
        name = f"e2e-{uuid.uuid4().hex[:8]}"
        cap = csi_pb2.VolumeCapability(
            access_mode=csi_pb2.VolumeCapability.AccessMode(
                mode=Mode.MULTI_NODE_READER_ONLY if "ReadOnlyMany" in modes else Mode.SINGLE_NODE_WRITER
            )
        )
        if block:
            cap.block.SetInParent()
        else:
            cap.mount.fs_type = fs_type
        resp = await self.csi.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=name,
                capacity_range=csi_pb2.CapacityRange(required_bytes=size_mi << 20),
                volume_capabilities=[cap],
            ),
            timeout=30,
        )
        handle = resp.volume.volume_id
        csi: Obj = {"driver": DRIVER_NAME, "volumeHandle": handle}
        if not block:
            csi["fsType"] = fs_type
        await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": name},
                "spec": {
                    "capacity": {"storage": f"{size_mi}Mi"},
                    "accessModes": list(modes),
                    "volumeMode": "Block" if block else "Filesystem",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": class_name,
                    "claimRef": {"namespace": namespace, "name": name},
                    "csi": csi,
                },
            },
        )
        await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "accessModes": list(modes),
                    "volumeMode": "Block" if block else "Filesystem",
                    "storageClassName": class_name,
                    "resources": {"requests": {"storage": f"{size_mi}Mi"}},
                },
            },
        )
        await wait_for(lambda: self._claim_bound(namespace, name), 30, f"claim {name} bound")
        return name, name, handle

    async def _claim_bound(self, namespace: str, name: str) -> bool:
        pvc = await self.api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
        return bool(pvc.get("status", {}).get("phase") == "Bound")

    async def delete_volume(self, namespace: str, pvc: str, pv: str, handle: str) -> None:
        assert self.csi is not None
        for res, ns, name in ((PERSISTENT_VOLUME_CLAIMS, namespace, pvc), (PERSISTENT_VOLUMES, None, pv)):
            try:
                await self.api.delete(res, name, ns)
            except ApiError as exc:
                if not exc.not_found:
                    raise
        await wait_for(lambda: _gone(self.api, PERSISTENT_VOLUMES, pv), 30, f"PV {pv} deleted")
        await self.csi.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=handle), timeout=30)

    # -- pods ---------------------------------------------------------------------------------------

    async def pod(
        self,
        namespace: str,
        name: str,
        node: str,
        claim: str,
        *,
        read_only: bool = False,
        block: bool = False,
    ) -> Obj:
        container: Obj = {"name": "app", "image": "registry.k8s.io/pause:3.10"}
        if block:
            container["volumeDevices"] = [{"name": "data", "devicePath": "/dev/xvda"}]
        else:
            container["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
        return await self.api.create(
            PODS,
            {
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 30,
                    "containers": [container],
                    "volumes": [
                        {"name": "data", "persistentVolumeClaim": {"claimName": claim, "readOnly": read_only}}
                    ],
                },
            },
        )

    async def wait_running(self, namespace: str, name: str, timeout: float = 60) -> Obj:
        async def running() -> Obj | None:
            pod = await self.api.get(PODS, name, namespace)
            return pod if pod.get("status", {}).get("phase") == "Running" else None

        pod: Obj = await wait_for(running, timeout, f"pod {namespace}/{name} running")
        return pod

    async def delete_pod(self, namespace: str, name: str, timeout: float = 60) -> None:
        await self.api.delete(PODS, name, namespace)
        await wait_for(lambda: _gone(self.api, PODS, name, namespace), timeout, f"pod {name} deleted")

    def mount_path(self, node: str, pod: Obj, pv: str) -> Path:
        return (
            self.kubelet_root(node)
            / "pods"
            / str(pod["metadata"]["uid"])
            / "volumes"
            / "kubernetes.io~csi"
            / pv
            / "mount"
        )

    def device_path(self, node: str, pod: Obj, pv: str) -> Path:
        return (
            self.kubelet_root(node)
            / "pods"
            / str(pod["metadata"]["uid"])
            / "volumeDevices"
            / "kubernetes.io~csi"
            / pv
            / "dev"
        )

    async def va(self, handle: str, node: str) -> Obj | None:
        try:
            return await self.api.get(VOLUME_ATTACHMENTS, va_name(handle, DRIVER_NAME, node))
        except ApiError as exc:
            if exc.not_found:
                return None
            raise

    async def wait_detached(self, handle: str, node: str, timeout: float = 60) -> None:
        name = va_name(handle, DRIVER_NAME, node)
        await wait_for(lambda: _gone(self.api, VOLUME_ATTACHMENTS, name), timeout, f"VA {name} gone")

    async def events(self, namespace: str, reason: str) -> list[Obj]:
        items, _ = await self.api.list_all(EVENTS, namespace)
        return [e for e in items if e.get("reason") == reason]

    def loop_devices(self, handle: str) -> list[str]:
        out: list[str] = []
        for pool in self.pools_dirs():
            backing = pool / "volumes" / f"{handle}.img"
            listed = subprocess.run(
                ["losetup", "-j", str(backing)], capture_output=True, text=True, check=False
            ).stdout
            out += [line.split(":")[0] for line in listed.splitlines() if line.strip()]
        return out

    def mounts(self) -> list[str]:
        return mounts_under(self.home)

    async def assert_clean(self, handle: str, timeout: float = 30) -> None:
        """Nothing of the volume is left on any node: no VA, no loop device, no mount."""
        for node in NODES:
            await self.wait_detached(handle, node, timeout)

        async def nothing_left() -> bool:
            return not self.loop_devices(handle) and not self.mounts()

        await wait_for(nothing_left, timeout, f"no loop device or mount left for {handle}")


async def _restarted(proc: ManagedProcess, restarts_before: int) -> bool:
    return proc.restarts > restarts_before and proc.running


async def _exists(api: ApiClient, res: Any, name: str, namespace: str | None = None) -> bool:
    try:
        await api.get(res, name, namespace)
        return True
    except ApiError as exc:
        if exc.not_found:
            return False
        raise


async def _gone(api: ApiClient, res: Any, name: str, namespace: str | None = None) -> bool:
    return not await _exists(api, res, name, namespace)


async def wait_for(
    check: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


__all__ = ["NODES", "StorageStack", "grpc", "loop_backing_files", "mounts_under", "wait_for"]
