"""VolumeSnapshots and VolumeGroupSnapshots in the local stack (`make up`): upstream's
snapshot-controller and csi-snapshotter (Go binaries at the pinned version, their CRDs applied by
the launcher) beside kubeloop's provisioner and driver, on the real apiserver. A claim's data is
snapshotted and restored into a new claim, read back by a pod on the other node; two claims in use
by running pods are snapshotted as a group and both restored; a filesystem's snapshot is restored
as a raw block volume only once an admin allows it on its VolumeSnapshotContent (issue 44)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    STORAGE_CLASSES,
    VOLUME_SNAPSHOT_CONTENTS,
    VOLUME_SNAPSHOTS,
    Obj,
    Resource,
)
from csi_driver import DRIVER_NAME
from localstack.controlplane import ControlPlane
from localstack.storage_stack import STORAGE_COMPONENTS, StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]

COMPONENTS = (*STORAGE_COMPONENTS, "external-provisioner", "snapshot-controller", "csi-snapshotter")
CLASS = "kubeloop-e2e-snap"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    try:
        await api.delete(STORAGE_CLASSES, CLASS)
    except ApiError as exc:
        if not exc.not_found:
            raise
    await api.create(STORAGE_CLASSES, {"metadata": {"name": CLASS}, "provisioner": DRIVER_NAME})
    s = StorageStack(control_plane, api, COMPONENTS)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()
        await api.delete(STORAGE_CLASSES, CLASS)


async def claim(stack: StorageStack, namespace: str, source: Obj | None = None, mode: str = "") -> str:
    name = f"c-{uuid.uuid4().hex[:6]}"
    spec: Obj = {
        "accessModes": ["ReadWriteOnce"],
        "storageClassName": CLASS,
        "resources": {"requests": {"storage": "64Mi"}},
    }
    if source is not None:
        spec["dataSource"] = source
    if mode:
        spec["volumeMode"] = mode
    await stack.api.create(PERSISTENT_VOLUME_CLAIMS, {"metadata": {"name": name}, "spec": spec}, namespace)
    return name


async def bound(stack: StorageStack, namespace: str, name: str) -> Obj:
    async def done() -> Obj | None:
        pvc = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)
        return pvc if (pvc.get("status") or {}).get("phase") == "Bound" else None

    pvc: Obj = await eventually_async(f"claim {name} bound", done, 60)
    return pvc


def write(path: Path, text: str) -> None:
    with open(path / "data.txt", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


async def snapshot(stack: StorageStack, namespace: str, source: str) -> Obj:
    name = f"s-{uuid.uuid4().hex[:6]}"
    body = {
        "metadata": {"name": name},
        "spec": {"volumeSnapshotClassName": "kubeloop", "source": {"persistentVolumeClaimName": source}},
    }
    await stack.api.create(VOLUME_SNAPSHOTS, body, namespace)

    async def ready() -> Obj | None:
        snap = await stack.api.get(VOLUME_SNAPSHOTS, name, namespace)
        return snap if (snap.get("status") or {}).get("readyToUse") else None

    snap: Obj = await eventually_async(f"snapshot {name} ready", ready, 60)
    return snap


async def test_a_snapshot_is_taken_and_restored_in_the_local_stack(
    stack: StorageStack, namespace: str
) -> None:
    source = await claim(stack, namespace)
    pv = (await bound(stack, namespace, source))["spec"]["volumeName"]
    pod = await stack.pod(namespace, "writer", "node-a", source)
    await stack.wait_running(namespace, "writer")
    write(stack.mount_path("node-a", pod, pv), "before the snapshot")
    await stack.delete_pod(namespace, "writer")  # the snapshot of a quiet filesystem

    snap = await snapshot(stack, namespace, source)
    content = await stack.api.get(VOLUME_SNAPSHOT_CONTENTS, snap["status"]["boundVolumeSnapshotContentName"])
    handle = content["status"]["snapshotHandle"]
    assert (stack.pool / "snapshots" / f"{handle}.img").exists()

    restored = await claim(
        stack,
        namespace,
        {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snap["metadata"]["name"]},
    )
    restored_pv = (await bound(stack, namespace, restored))["spec"]["volumeName"]
    reader = await stack.pod(namespace, "reader", "node-b", restored)
    await stack.wait_running(namespace, "reader")
    assert (stack.mount_path("node-b", reader, restored_pv) / "data.txt").read_text() == "before the snapshot"
    await stack.delete_pod(namespace, "reader")

    # Deleting the snapshot (deletionPolicy Delete) deletes its copy in the pool.
    await stack.api.delete(VOLUME_SNAPSHOTS, snap["metadata"]["name"], namespace)

    async def copy_gone() -> bool:
        return not (stack.pool / "snapshots" / f"{handle}.img").exists()

    await eventually_async("the snapshot's copy deleted", copy_gone, 60)
    for name in (restored, source):
        await stack.api.delete(PERSISTENT_VOLUME_CLAIMS, name, namespace)


GROUP_CLASS = "kubeloop-e2e-group"
VGS = Resource("groupsnapshot.storage.k8s.io", "v1", "volumegroupsnapshots", "VolumeGroupSnapshot", True)
VGS_CLASSES = Resource(
    "groupsnapshot.storage.k8s.io", "v1", "volumegroupsnapshotclasses", "VolumeGroupSnapshotClass", False
)


async def test_a_group_snapshot_of_two_claims_in_use_restores_both(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    try:
        await api.delete(VGS_CLASSES, GROUP_CLASS)
    except ApiError as exc:
        if not exc.not_found:
            raise
    await api.create(
        VGS_CLASSES, {"metadata": {"name": GROUP_CLASS}, "driver": DRIVER_NAME, "deletionPolicy": "Delete"}
    )
    written: dict[str, str] = {}
    for i, node in enumerate(("node-a", "node-b")):
        name = await claim(stack, namespace)
        await api.patch(PERSISTENT_VOLUME_CLAIMS, name, {"metadata": {"labels": {"app": "pair"}}}, namespace)
        pv = (await bound(stack, namespace, name))["spec"]["volumeName"]
        pod = await stack.pod(namespace, f"app-{i}", node, name)
        await stack.wait_running(namespace, f"app-{i}")
        write(stack.mount_path(node, pod, pv), f"claim {i}")
        written[name] = f"claim {i}"
    # Taken while both pods run: their filesystems are frozen for the copy.
    body = {
        "metadata": {"name": "pair"},
        "spec": {
            "volumeGroupSnapshotClassName": GROUP_CLASS,
            "source": {"selector": {"matchLabels": {"app": "pair"}}},
        },
    }
    await api.create(VGS, body, namespace)

    async def ready() -> Obj | None:
        group = await api.get(VGS, "pair", namespace)
        return group if (group.get("status") or {}).get("readyToUse") else None

    await eventually_async("the group snapshot ready", ready, 90)
    snaps, _ = await api.list_all(VOLUME_SNAPSHOTS, namespace)
    members = [
        s
        for s in snaps
        if any(o.get("kind") == "VolumeGroupSnapshot" for o in s["metadata"].get("ownerReferences") or [])
    ]
    assert len(members) == 2, [s["metadata"]["name"] for s in snaps]
    restored: list[str] = []
    for i, member in enumerate(members):
        source = {
            "apiGroup": "snapshot.storage.k8s.io",
            "kind": "VolumeSnapshot",
            "name": member["metadata"]["name"],
        }
        name = await claim(stack, namespace, source)
        pv = (await bound(stack, namespace, name))["spec"]["volumeName"]
        pod = await stack.pod(namespace, f"reader-{i}", "node-a", name)
        await stack.wait_running(namespace, f"reader-{i}")
        restored.append((stack.mount_path("node-a", pod, pv) / "data.txt").read_text())
        await stack.delete_pod(namespace, f"reader-{i}")
    assert sorted(restored) == sorted(written.values())
    for i in range(2):
        await stack.delete_pod(namespace, f"app-{i}")
    await api.delete(VGS, "pair", namespace)

    async def copies_gone() -> bool:
        return not list((stack.pool / "snapshots").iterdir())

    await eventually_async("the group's copies deleted", copies_gone, 60)

    async def members_gone() -> bool:
        left, _ = await api.list_all(VOLUME_SNAPSHOTS, namespace)
        return not [s for s in left if s["metadata"]["name"] in {m["metadata"]["name"] for m in members}]

    await eventually_async("the group's member VolumeSnapshots deleted with it", members_gone, 60)
    await api.delete(VGS_CLASSES, GROUP_CLASS)


async def failed(stack: StorageStack, namespace: str, name: str) -> str:
    """The provisioner's first ProvisioningFailed message on the claim."""

    async def found() -> str | None:
        for event in await stack.events(namespace, "ProvisioningFailed"):
            if event["involvedObject"].get("name") == name:
                return str(event["message"])
        return None

    message: str = await eventually_async(f"ProvisioningFailed on {name}", found, 60)
    return message


async def test_a_filesystem_snapshot_becomes_a_block_volume_only_once_allowed(
    stack: StorageStack, namespace: str
) -> None:
    """KEP-3141 on the real stack: the snapshot-controller records the source's volume mode on the
    content, the provisioner refuses a Block restore of it with upstream's event text (and a Block
    clone of the filesystem claim, which nothing can allow), and the same claim is provisioned once
    an admin annotates the content: its raw device holds the filesystem, file contents included."""
    source = await claim(stack, namespace)
    pv = (await bound(stack, namespace, source))["spec"]["volumeName"]
    pod = await stack.pod(namespace, "writer", "node-a", source)
    await stack.wait_running(namespace, "writer")
    write(stack.mount_path("node-a", pod, pv), "kubeloop secret of the filesystem")
    await stack.delete_pod(namespace, "writer")
    snap = await snapshot(stack, namespace, source)
    snap_name, content_name = snap["metadata"]["name"], snap["status"]["boundVolumeSnapshotContentName"]
    content = await stack.api.get(VOLUME_SNAPSHOT_CONTENTS, content_name)
    assert content["spec"].get("sourceVolumeMode") == "Filesystem", content["spec"]

    ref = {"apiGroup": "snapshot.storage.k8s.io", "kind": "VolumeSnapshot", "name": snap_name}
    raw = await claim(stack, namespace, ref, mode="Block")
    assert await failed(stack, namespace, raw) == (
        f"error getting handle for DataSource Type VolumeSnapshot by Name {snap_name}: requested volume "
        f"{namespace}/{raw} modifies the mode of the source volume but does not have permission to do so. "
        "snapshot.storage.kubernetes.io/allow-volume-mode-change annotation is not present on "
        f"snapshotcontent {content_name}"
    )
    clone = await claim(stack, namespace, {"kind": "PersistentVolumeClaim", "name": source}, mode="Block")
    assert await failed(stack, namespace, clone) == (
        f"error getting handle for DataSource Type PersistentVolumeClaim by Name {source}: the source PVC "
        "and destination PVCs must have the same volume mode for cloning.  Source is Filesystem, but new "
        "PVC requested Block"
    )
    pending = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, raw, namespace)
    assert pending["status"].get("phase") == "Pending" and not pending["spec"].get("volumeName")

    allow = {"metadata": {"annotations": {"snapshot.storage.kubernetes.io/allow-volume-mode-change": "true"}}}
    await stack.api.patch(VOLUME_SNAPSHOT_CONTENTS, content_name, allow)
    raw_pv = (await bound(stack, namespace, raw))["spec"]["volumeName"]
    assert (await stack.api.get(PERSISTENT_VOLUMES, raw_pv))["spec"]["volumeMode"] == "Block"
    reader = await stack.pod(namespace, "reader", "node-b", raw, block=True)
    await stack.wait_running(namespace, "reader")
    image = stack.device_path("node-b", reader, raw_pv).read_bytes()
    assert int.from_bytes(image[1080:1082], "little") == 0xEF53, "no ext4 superblock on the raw device"
    assert b"kubeloop secret of the filesystem" in image
    await stack.delete_pod(namespace, "reader")
    clone_claim = await stack.api.get(PERSISTENT_VOLUME_CLAIMS, clone, namespace)
    assert clone_claim["status"].get("phase") == "Pending", "a clone's mode change is never allowed"
    for name in (raw, clone, source):
        await stack.api.delete(PERSISTENT_VOLUME_CLAIMS, name, namespace)
    # The snapshot goes while the snapshot-controller runs: left to the namespace's deletion, it
    # would keep the controller's finalizers after the stack stops, and the session's apiserver
    # could never delete the snapshot CRDs (a later test does).
    await stack.api.delete(VOLUME_SNAPSHOTS, snap_name, namespace)

    async def snapshot_gone() -> bool:
        try:
            await stack.api.get(VOLUME_SNAPSHOTS, snap_name, namespace)
        except ApiError as exc:
            if exc.not_found:
                return True
            raise
        return False

    await eventually_async(f"snapshot {snap_name} deleted", snapshot_gone, 60)
