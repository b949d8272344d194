"""The external-attacher's test setup, shared by its tests and those under upstream's RBAC: the real
CSI driver (`--mode controller`, a subprocess on a temporary pool), a node plugin, the objects a
VolumeAttachment needs (Node, CSINode, PV) and the attacher in-process (`Setup`, the `setup`
fixture); `FINALIZER` is the attacher's finalizer of the driver and `get` an object or None."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import (
    CSI_NODES,
    NODES,
    PERSISTENT_VOLUMES,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import attacher_finalizer, va_name
from csi_driver import DRIVER_NAME
from external_attacher.controller import Attacher, Options
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.csi.conftest import Driver
from tests.support import in_process

FINALIZER = attacher_finalizer(DRIVER_NAME)


async def get(api: ApiClient, res: object, name: str) -> Obj | None:
    try:
        return await api.get(res, name)  # type: ignore[arg-type]
    except ApiError as exc:
        if exc.not_found:
            return None
        raise


class Setup:
    def __init__(self, cp: ControlPlane, api: ApiClient) -> None:
        self.cp, self.api = cp, api
        self.suffix = uuid.uuid4().hex[:6]
        self.node = f"att-{self.suffix}"
        self.pv = f"att-pv-{self.suffix}"
        # Short: the driver's socket path may not exceed 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="ea", dir="/tmp"))
        self.driver = Driver(self.root / "c", "controller", self.node, pool=self.root / "pool")
        # The driver publishes only to nodes whose node plugin announced itself in the pool.
        self.node_plugin = Driver(self.root / "n", "node", self.node, pool=self.root / "pool")
        for d in (self.driver, self.node_plugin):
            d.root.mkdir()
            d.start()
        self.tasks: list[asyncio.Task[None]] = []
        self.closers: list[Callable[[], Awaitable[None]]] = []

    async def start_attacher(self, kubeconfig: Path | None = None) -> tuple[Attacher, CSIConnection]:
        """The attacher, as the admin or as the identity of `kubeconfig`."""
        csi = await CSIConnection.connect(self.driver.endpoint, timeout=10)
        client = await ApiClient.from_kubeconfig(str(kubeconfig or self.cp.admin_kubeconfig), qps=0, burst=1)
        recorder = EventRecorder(client, "csi-attacher")
        self.closers += [csi.close, recorder.close, client.close]
        factory = SharedInformerFactory(client)
        # The periodic ListVolumes pass is run by hand below, so that it runs exactly when wanted.
        attacher = Attacher(ControllerContext(client, factory, recorder), csi, Options(reconcile_sync=0))
        self.tasks.append(asyncio.create_task(attacher.run()))
        await asyncio.wait_for(factory.wait_for_sync(), 30)
        return attacher, csi

    async def objects(self, csi: CSIConnection) -> str:
        """A volume in the driver, its static PV, the Node and its CSINode; returns the handle."""
        vol = await csi.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name=f"att-{self.suffix}",
                capacity_range=csi_pb2.CapacityRange(required_bytes=16 << 20),
                volume_capabilities=[
                    csi_pb2.VolumeCapability(
                        mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
                        access_mode=csi_pb2.VolumeCapability.AccessMode(
                            mode=csi_pb2.VolumeCapability.AccessMode.SINGLE_NODE_WRITER
                        ),
                    )
                ],
            ),
            timeout=60,
        )
        handle = str(vol.volume.volume_id)
        await self.api.create(NODES, {"metadata": {"name": self.node}})
        await self.api.create(
            CSI_NODES,
            {
                "metadata": {"name": self.node},
                "spec": {"drivers": [{"name": DRIVER_NAME, "nodeID": self.node, "topologyKeys": []}]},
            },
        )
        await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": self.pv},
                "spec": {
                    "capacity": {"storage": "16Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "csi": {"driver": DRIVER_NAME, "volumeHandle": handle, "fsType": "ext4"},
                },
            },
        )
        return handle

    async def create_va(self, handle: str) -> str:
        """The VolumeAttachment of the volume to the node, as the attach-detach controller makes it."""
        name = va_name(handle, DRIVER_NAME, self.node)
        spec = {"attacher": DRIVER_NAME, "nodeName": self.node, "source": {"persistentVolumeName": self.pv}}
        await self.api.create(VOLUME_ATTACHMENTS, {"metadata": {"name": name}, "spec": spec})
        return name

    async def published(self, csi: CSIConnection, handle: str) -> list[str]:
        resp = await csi.controller.ListVolumes(csi_pb2.ListVolumesRequest(), timeout=10)
        return [n for e in resp.entries if e.volume.volume_id == handle for n in e.status.published_node_ids]

    async def close(self) -> None:
        await in_process.stop(self.tasks, self.closers)
        for res, name in ((NODES, self.node), (CSI_NODES, self.node), (PERSISTENT_VOLUMES, self.pv)):
            with contextlib.suppress(ApiError):
                await self.api.patch(res, name, {"metadata": {"finalizers": None}})
            with contextlib.suppress(ApiError):
                await self.api.delete(res, name)
        self.driver.stop()
        self.node_plugin.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def setup(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[Setup]:
    s = Setup(control_plane, api)
    try:
        yield s
    finally:
        await s.close()
