"""The external-resizer against the real apiserver and the real CSI driver (`--mode controller`, a
subprocess on a temporary pool), in-process, with the ControllerExpandVolume requests recorded on
their way to the driver: what reaches the driver from a claim and its PV (issue 29). A claim's
author can name any resizer in its storage-resizer annotation; the PV's controllerExpandSecretRef,
access modes and fsType are what ControllerExpandVolume is built from. The claims are made Bound
by the test, as the pv-controller would (kcm's binder is off in the test control plane)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resize_status import RESIZER_ANNOTATION
from controller_runtime.resources import EVENTS, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, SECRETS, Obj
from csi_driver import DRIVER_NAME
from external_resizer.controller import Options, Resizer
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.csi.conftest import Driver

pytestmark = pytest.mark.integration

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


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


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
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for close in self.closers:
            await close()
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


async def test_a_claim_naming_this_resizer_is_not_enough(setup: Setup) -> None:
    """The storage-resizer annotation counts upstream only for a driver that in-tree volumes
    migrate to. kubeloop's resizer took any claim annotated with its driver's name: it marked a
    claim of another driver's volume as resizing and asked its own driver to expand that
    driver's handle, and crashed its sync on a claim of a non-CSI volume (after marking it)."""
    s, api = setup, setup.api
    csi = await s.start_resizer()
    mine = {RESIZER_ANNOTATION: DRIVER_NAME}
    foreign = {"csi": {"driver": "other.csi.example.com", "volumeHandle": "theirs"}}
    other_pv = await s.bound_claim("other", foreign, annotations=mine)
    local_pv = await s.bound_claim("local", {"hostPath": {"path": "/tmp/kubeloop-nowhere"}}, annotations=mine)
    await asyncio.sleep(3)  # several syncs and retries' worth
    assert csi.expands == []
    for claim, pv in (("other", other_pv), ("local", local_pv)):
        status = (await api.get(PERSISTENT_VOLUME_CLAIMS, claim, s.ns))["status"]
        assert status == {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "16Mi"}}
        assert (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"] == {"storage": "16Mi"}
        assert await s.events(claim) == []


async def test_expand_request_carries_the_pv_secret_and_its_access_mode(setup: Setup) -> None:
    """ControllerExpandVolume as csi-resizer sends it: with the PV's controllerExpandSecretRef
    (a Secret that cannot be read fails the attempt, before the driver is asked), and with the
    access mode from csi-lib-utils' mapping of the PV's modes (SINGLE_NODE_MULTI_WRITER for RWO on
    a driver that has it; ReadOnlyMany with ReadWriteOnce refused). kubeloop sent no secrets,
    always SINGLE_NODE_WRITER, and ReadOnlyMany for the pair."""
    s, api = setup, setup.api
    csi = await s.start_resizer()
    handle = await s.volume(csi, "grow")
    ref = {"name": "expand", "namespace": s.ns}
    pv = await s.bound_claim(
        "grow",
        {
            "csi": {
                "driver": DRIVER_NAME,
                "volumeHandle": handle,
                "fsType": "ext4",
                "controllerExpandSecretRef": ref,
            }
        },
    )
    want = f'resize volume "{pv}" by resizer "{DRIVER_NAME}" failed: '

    async def failed(claim: str, text: str) -> bool:
        return bool(("VolumeResizeFailed", want + text) in await s.events(claim))

    await wait_for(
        lambda: failed(
            "grow", f'error getting secret expand in namespace {s.ns}: secrets "expand" not found'
        ),
        20,
        "VolumeResizeFailed for the missing Secret",
    )
    assert csi.expands == [], "the driver was asked without the Secret"

    await api.create(
        SECRETS, {"metadata": {"name": "expand"}, "data": {"key": base64.b64encode(b"v").decode()}}, s.ns
    )

    async def grown() -> bool:
        return bool((await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"] == {"storage": "32Mi"})

    await wait_for(grown, 20, "the PV grown to 32Mi")
    req = csi.expands[-1]
    assert req.volume_id == handle and req.capacity_range.required_bytes == 32 * MiB
    assert dict(req.secrets) == {"key": "v"}
    assert req.volume_capability.access_mode.mode == Mode.SINGLE_NODE_MULTI_WRITER
    assert req.volume_capability.mount.fs_type == "ext4"

    both = await s.volume(csi, "both")
    pv = await s.bound_claim(
        "both",
        {"csi": {"driver": DRIVER_NAME, "volumeHandle": both}},
        modes=("ReadWriteOnce", "ReadOnlyMany"),
    )
    want = f'resize volume "{pv}" by resizer "{DRIVER_NAME}" failed: '
    await wait_for(
        lambda: failed(
            "both",
            f"failed to get capabilities of volume {pv} with "
            "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume",
        ),
        20,
        "VolumeResizeFailed for ReadOnlyMany with ReadWriteOnce",
    )
    assert [r.volume_id for r in csi.expands].count(both) == 0
