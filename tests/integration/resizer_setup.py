"""The external-resizer's test setup, shared by its tests, those of node deployment and those under
upstream's RBAC: the real CSI driver (`--mode controller`, a subprocess on a temporary pool), its
ControllerExpandVolume requests recorded on their way (`Recording`), Bound claims and their PVs
made as the pv-controller would (`Setup`, the `setup` fixture), and `rwo_volume`."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import EVENTS, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj
from external_resizer.controller import Options, Resizer
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.csi.conftest import Driver
from tests.support import in_process

Mode = csi_pb2.VolumeCapability.AccessMode.Mode
MiB = 1 << 20


async def rwo_volume(csi: CSIConnection, name: str) -> str:
    """A 16 MiB volume in the driver, created as the provisioner creates one for RWO."""
    cap = csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type="ext4"),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=Mode.SINGLE_NODE_MULTI_WRITER),
    )
    rsp = await csi.controller.CreateVolume(
        csi_pb2.CreateVolumeRequest(
            name=name,
            capacity_range=csi_pb2.CapacityRange(required_bytes=16 * MiB),
            volume_capabilities=[cap],
        ),
        timeout=60,
    )
    return str(rsp.volume.volume_id)


@dataclass
class Recording(CSIConnection):
    """The driver's connection, keeping every ControllerExpandVolume request the resizer sends."""

    expands: list[csi_pb2.ControllerExpandVolumeRequest] = field(default_factory=list)

    @property
    def controller(self) -> Any:
        stub, expands = super().controller, self.expands

        class Controller:
            def __getattr__(self, name: str) -> Any:
                return getattr(stub, name)

            async def ControllerExpandVolume(self, req: Any, **kwargs: Any) -> Any:
                expands.append(req)
                return await stub.ControllerExpandVolume(req, **kwargs)

        return Controller()


class Setup:
    def __init__(self, cp: ControlPlane, api: ApiClient, namespace: str) -> None:
        self.cp, self.api, self.ns = cp, api, namespace
        self.suffix = uuid.uuid4().hex[:6]
        # Short: the driver's socket path may not exceed 107 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="er", dir="/tmp"))
        self.driver = Driver(self.root / "c", "controller", f"rs-{self.suffix}", pool=self.root / "pool")
        self.driver.root.mkdir()
        self.driver.start()
        self.pvs: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.closers: list[Callable[[], Awaitable[None]]] = []

    async def start_resizer(self, kubeconfig: Path | None = None) -> Recording:
        """The resizer, as the admin or as the identity of `kubeconfig`."""
        csi = await Recording.connect(self.driver.endpoint, timeout=10)
        assert isinstance(csi, Recording)
        client = await ApiClient.from_kubeconfig(str(kubeconfig or self.cp.admin_kubeconfig), qps=0, burst=1)
        recorder = EventRecorder(client, "external-resizer")
        self.closers += [csi.close, recorder.close, client.close]
        factory = SharedInformerFactory(client)
        options = Options(retry_start=0.2, retry_max=1.0, handle_volume_in_use_error=False)
        resizer = Resizer(ControllerContext(client, factory, recorder), csi, options)
        self.tasks.append(asyncio.create_task(resizer.run()))
        await asyncio.wait_for(factory.wait_for_sync(), 30)
        return csi

    async def volume(self, csi: CSIConnection, name: str) -> str:
        return await rwo_volume(csi, f"{name}-{self.suffix}")

    async def bound_claim(
        self,
        name: str,
        source: Obj,
        *,
        modes: tuple[str, ...] = ("ReadWriteOnce",),
        annotations: Obj | None = None,
    ) -> str:
        """A claim asking for 32Mi, Bound to a new 16Mi PV with `source` (spec.csi, or another
        volume source); returns the PV's name."""
        pv_name = f"{name}-{self.suffix}"
        claim = await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": name, "annotations": annotations or {}},
                "spec": {
                    "accessModes": list(modes),
                    "resources": {"requests": {"storage": "32Mi"}},
                    "storageClassName": "",
                    "volumeName": pv_name,
                },
            },
            self.ns,
        )
        md = claim["metadata"]
        await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": pv_name},
                "spec": {
                    "capacity": {"storage": "16Mi"},
                    "accessModes": list(modes),
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "claimRef": {"namespace": self.ns, "name": name, "uid": md["uid"]},
                    **source,
                },
            },
        )
        self.pvs.append(pv_name)
        claim["status"] = {"phase": "Bound", "accessModes": list(modes), "capacity": {"storage": "16Mi"}}
        await self.api.update_status(PERSISTENT_VOLUME_CLAIMS, claim)
        return pv_name

    async def events(self, claim: str) -> list[tuple[str, str]]:
        items = (await self.api.list_page(EVENTS, self.ns))["items"]
        return [(e["reason"], e["message"]) for e in items if e["involvedObject"].get("name") == claim]

    async def close(self) -> None:
        await in_process.stop(self.tasks, self.closers)
        for name in self.pvs:
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUMES, name)
        self.driver.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def setup(control_plane: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[Setup]:
    s = Setup(control_plane, api, namespace)
    try:
        yield s
    finally:
        await s.close()
