"""The external-attacher against the real apiserver and the real CSI driver (`--mode controller`,
a subprocess on a temporary pool), in-process: what csi-attacher v4.13 leaves on the objects
(the VA's finalizer and node-id annotation, the PV's finalizer until the PV is deleted), a
detach after the node's CSINode is gone, and the ListVolumes pass re-publishing what the driver
lost. The VolumeAttachment is created by the test, as the attach-detach controller would."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable

from controller_runtime.client import ApiError
from controller_runtime.resources import (
    CSI_NODES,
    NODES,
    PERSISTENT_VOLUMES,
    SECRETS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from csi_driver import DRIVER_NAME
from external_attacher.controller import ANN_VA_NODE_ID, Attacher
from kubeloop_grpc.csi import csi_pb2
from tests.support.waits import consistently_async, eventually_async

from .attacher_setup import FINALIZER, Setup, get, setup

__all__ = ["setup"]  # the fixture


async def test_attach_detach_and_list_volumes_as_csi_attacher(setup: Setup) -> None:
    s, api = setup, setup.api
    attacher, csi = await s.start_attacher()
    handle = await s.objects(csi)
    name = await s.create_va(handle)

    async def attached() -> bool:
        va = await get(api, VOLUME_ATTACHMENTS, name)
        return bool(va and (va.get("status") or {}).get("attached"))

    await eventually_async("the VolumeAttachment attached", attached, 20)
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

    await eventually_async("ControllerPublishVolume again", republished, 20)
    assert await attacher.reconcile_published() == 0

    # The node and its CSINode go first: the detach takes the node id from the annotation.
    await api.delete(CSI_NODES, s.node)
    await api.delete(NODES, s.node)
    await eventually_async("the CSINode out of the cache", lambda: _gone_from_cache(attacher, s.node), 20)
    await api.delete(VOLUME_ATTACHMENTS, name)

    async def va_gone() -> bool:
        return await get(api, VOLUME_ATTACHMENTS, name) is None

    await eventually_async("the VolumeAttachment detached and gone", va_gone, 20)
    assert await s.published(csi, handle) == []

    async def kept() -> bool:
        return FINALIZER in (await api.get(PERSISTENT_VOLUMES, s.pv))["metadata"]["finalizers"]

    await consistently_async("the PV's finalizer kept while the PV is not being deleted", kept, 0.5)
    await api.delete(PERSISTENT_VOLUMES, s.pv)

    async def pv_gone() -> bool:
        return await get(api, PERSISTENT_VOLUMES, s.pv) is None

    await eventually_async("the PV's attacher finalizer removed once it is being deleted", pv_gone, 20)


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
        await eventually_async(
            "attachError for ReadOnlyMany+ReadWriteOnce", status_says(both, "attachError", message), 20
        )
        va = await api.get(VOLUME_ATTACHMENTS, both)
        assert not (va.get("status") or {}).get("attached") and not va["metadata"].get("finalizers")
        assert await s.published(csi, handle) == []
        await api.delete(VOLUME_ATTACHMENTS, both)

        ref = {"name": "publish", "namespace": namespace}
        secret = await attachment(f"{s.pv}-sec", {"controllerPublishSecretRef": ref}, ["ReadWriteOnce"])
        missing = f'failed to load secret "{namespace}/publish": secrets "publish" not found'
        await eventually_async(
            "attachError for the missing Secret", status_says(secret, "attachError", missing), 20
        )
        assert await s.published(csi, handle) == []
        await api.create(SECRETS, {"metadata": {"name": "publish"}, "data": {"k": "dg=="}}, namespace)

        async def attached() -> bool:
            va = await get(api, VOLUME_ATTACHMENTS, secret)
            return bool(va and (va.get("status") or {}).get("attached"))

        await eventually_async("attached once the Secret exists", attached, 20)
        assert await s.published(csi, handle) == [s.node]

        # The Secret goes before the detach: the detach waits for it, as csi-attacher's does.
        await api.delete(SECRETS, "publish", namespace)
        await api.delete(VOLUME_ATTACHMENTS, secret)
        await eventually_async(
            "detachError for the missing Secret", status_says(secret, "detachError", missing), 20
        )
        assert await s.published(csi, handle) == [s.node]
        await api.create(SECRETS, {"metadata": {"name": "publish"}, "data": {"k": "dg=="}}, namespace)

        async def detached() -> bool:
            return await get(api, VOLUME_ATTACHMENTS, secret) is None

        await eventually_async("detached once the Secret is back", detached, 20)
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
