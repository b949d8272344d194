"""The external-attacher against the real apiserver and the real CSI driver (`--mode controller`,
a subprocess on a temporary pool), in-process: what csi-attacher v4.13 leaves on the objects
(the VA's finalizer and node-id annotation, the PV's finalizer until the PV is deleted), a
detach after the node's CSINode is gone, and the ListVolumes pass re-publishing what the driver
lost. The VolumeAttachment is created by the test, as the attach-detach controller would."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
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
    SECRETS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import attacher_finalizer, va_name
from csi_driver import DRIVER_NAME
from external_attacher.controller import ANN_VA_NODE_ID, Attacher, Options
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.csi.conftest import Driver

FINALIZER = attacher_finalizer(DRIVER_NAME)


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


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
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for close in self.closers:
            await close()
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


async def test_attach_detach_and_list_volumes_as_csi_attacher(setup: Setup) -> None:
    s, api = setup, setup.api
    attacher, csi = await s.start_attacher()
    handle = await s.objects(csi)
    name = await s.create_va(handle)

    async def attached() -> bool:
        va = await get(api, VOLUME_ATTACHMENTS, name)
        return bool(va and (va.get("status") or {}).get("attached"))

    await wait_for(attached, 20, "the VolumeAttachment attached")
    va = await api.get(VOLUME_ATTACHMENTS, name)
    assert va["metadata"]["finalizers"] == [FINALIZER]
    assert va["metadata"]["annotations"] == {ANN_VA_NODE_ID: s.node}
    assert FINALIZER in (await api.get(PERSISTENT_VOLUMES, s.pv))["metadata"]["finalizers"]
    assert await s.published(csi, handle) == [s.node]

    # The driver loses the publication behind the attacher's back; the ListVolumes pass notices
    # and the forced sync publishes again although the status already says attached.
    await csi.controller.ControllerUnpublishVolume(
        csi_pb2.ControllerUnpublishVolumeRequest(volume_id=handle, node_id=s.node), timeout=10
    )
    assert await attacher.reconcile_published() == 1

    async def republished() -> bool:
        return await s.published(csi, handle) == [s.node]

    await wait_for(republished, 20, "ControllerPublishVolume again")
    assert await attacher.reconcile_published() == 0

    # The node and its CSINode go first: the detach takes the node id from the annotation.
    await api.delete(CSI_NODES, s.node)
    await api.delete(NODES, s.node)
    await wait_for(lambda: _gone_from_cache(attacher, s.node), 20, "the CSINode out of the cache")
    await api.delete(VOLUME_ATTACHMENTS, name)

    async def va_gone() -> bool:
        return await get(api, VOLUME_ATTACHMENTS, name) is None

    await wait_for(va_gone, 20, "the VolumeAttachment detached and gone")
    assert await s.published(csi, handle) == []

    await asyncio.sleep(0.5)
    pv = await api.get(PERSISTENT_VOLUMES, s.pv)
    assert FINALIZER in pv["metadata"]["finalizers"], "kept while the PV is not being deleted"
    await api.delete(PERSISTENT_VOLUMES, s.pv)

    async def pv_gone() -> bool:
        return await get(api, PERSISTENT_VOLUMES, s.pv) is None

    await wait_for(pv_gone, 20, "the PV's attacher finalizer removed once it is being deleted")


async def _gone_from_cache(attacher: Attacher, node: str) -> bool:
    return attacher.csinodes.store.get(node) is None


async def test_publish_carries_the_pv_secret_and_refuses_modes_csi_cannot_express(
    setup: Setup, namespace: str
) -> None:
    """What ControllerPublishVolume is built from (issue 29), as csi-attacher builds it: the PV's
    controllerPublishSecretRef is read for attach and detach (one that cannot be read fails them,
    recorded in attachError / detachError), and a PV listing ReadOnlyMany with ReadWriteOnce is
    refused (csi-lib-utils has no CSI mode for the pair). kubeloop published without the Secret,
    detached without it, and published the pair as ReadOnlyMany."""
    s, api = setup, setup.api
    _, csi = await s.start_attacher()
    handle = await s.objects(csi)
    pvs: list[str] = []

    async def attachment(pv: str, csi_extra: Obj, modes: list[str]) -> str:
        await api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": pv},
                "spec": {
                    "capacity": {"storage": "16Mi"},
                    "accessModes": modes,
                    "persistentVolumeReclaimPolicy": "Retain",
                    "csi": {"driver": DRIVER_NAME, "volumeHandle": handle, "fsType": "ext4", **csi_extra},
                },
            },
        )
        pvs.append(pv)
        name = f"va-{pv}"  # not csi-<hash>: the two PVs share the handle and the node
        spec = {"attacher": DRIVER_NAME, "nodeName": s.node, "source": {"persistentVolumeName": pv}}
        await api.create(VOLUME_ATTACHMENTS, {"metadata": {"name": name}, "spec": spec})
        return name

    def status_says(name: str, field: str, message: str) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            va = await get(api, VOLUME_ATTACHMENTS, name)
            return bool(va and ((va.get("status") or {}).get(field) or {}).get("message") == message)

        return check

    try:
        both = await attachment(f"{s.pv}-both", {}, ["ReadWriteOnce", "ReadOnlyMany"])
        message = "CSI does not support ReadOnlyMany and ReadWriteOnce on the same PersistentVolume"
        await wait_for(
            status_says(both, "attachError", message), 20, "attachError for ReadOnlyMany+ReadWriteOnce"
        )
        va = await api.get(VOLUME_ATTACHMENTS, both)
        assert not (va.get("status") or {}).get("attached") and not va["metadata"].get("finalizers")
        assert await s.published(csi, handle) == []
        await api.delete(VOLUME_ATTACHMENTS, both)

        ref = {"name": "publish", "namespace": namespace}
        secret = await attachment(f"{s.pv}-sec", {"controllerPublishSecretRef": ref}, ["ReadWriteOnce"])
        missing = f'failed to load secret "{namespace}/publish": secrets "publish" not found'
        await wait_for(status_says(secret, "attachError", missing), 20, "attachError for the missing Secret")
        assert await s.published(csi, handle) == []
        await api.create(SECRETS, {"metadata": {"name": "publish"}, "data": {"k": "dg=="}}, namespace)

        async def attached() -> bool:
            va = await get(api, VOLUME_ATTACHMENTS, secret)
            return bool(va and (va.get("status") or {}).get("attached"))

        await wait_for(attached, 20, "attached once the Secret exists")
        assert await s.published(csi, handle) == [s.node]

        # The Secret goes before the detach: the detach waits for it, as csi-attacher's does.
        await api.delete(SECRETS, "publish", namespace)
        await api.delete(VOLUME_ATTACHMENTS, secret)
        await wait_for(status_says(secret, "detachError", missing), 20, "detachError for the missing Secret")
        assert await s.published(csi, handle) == [s.node]
        await api.create(SECRETS, {"metadata": {"name": "publish"}, "data": {"k": "dg=="}}, namespace)

        async def detached() -> bool:
            return await get(api, VOLUME_ATTACHMENTS, secret) is None

        await wait_for(detached, 20, "detached once the Secret is back")
        assert await s.published(csi, handle) == []
    finally:
        for pv in pvs:
            with contextlib.suppress(ApiError):
                await api.patch(PERSISTENT_VOLUMES, pv, {"metadata": {"finalizers": None}})
            with contextlib.suppress(ApiError):
                await api.delete(PERSISTENT_VOLUMES, pv)
        for va in (await api.list_page(VOLUME_ATTACHMENTS))["items"]:
            if va["spec"]["source"].get("persistentVolumeName") in pvs:
                clear = {"metadata": {"finalizers": None}}
                with contextlib.suppress(ApiError):
                    await api.patch(VOLUME_ATTACHMENTS, va["metadata"]["name"], clear)
                with contextlib.suppress(ApiError):
                    await api.delete(VOLUME_ATTACHMENTS, va["metadata"]["name"])
