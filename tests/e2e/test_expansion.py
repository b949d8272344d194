"""Volume expansion end to end: the real apiserver (its validation and the PersistentVolumeClaimResize
admission plugin), kubeloop's expand controller, external-resizer, node agents and the real CSI
driver on loop devices. Each test checks the sizes the filesystem or device really has, and the
data written before the resize."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime import resize_status as rs
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.kinds import pvc_view
from controller_runtime.resources import PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, STORAGE_CLASSES, Obj
from csi_driver import DRIVER_NAME
from localstack.controlplane import ControlPlane
from localstack.storage_stack import STORAGE_COMPONENTS, StorageStack
from tests.support.waits import consistently_async, eventually_async, no_problems

pytestmark = [pytest.mark.integration, pytest.mark.root]

MI = 1 << 20
EXPANDABLE = "kubeloop-e2e-expandable"
FIXED = "kubeloop-e2e-fixed"
COMPONENTS = (*STORAGE_COMPONENTS, "volume-expand-controller", "external-resizer")


def has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(eff.split()[1], 16) >> 24 & 1)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    for name, allow in ((EXPANDABLE, True), (FIXED, False)):
        try:
            await api.delete(STORAGE_CLASSES, name)
        except ApiError as exc:
            if not exc.not_found:
                raise
        await api.create(
            STORAGE_CLASSES,
            {"metadata": {"name": name}, "provisioner": DRIVER_NAME, "allowVolumeExpansion": allow},
        )
    s = StorageStack(control_plane, api, COMPONENTS)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()
        for name in (EXPANDABLE, FIXED):
            await api.delete(STORAGE_CLASSES, name)


def write(path: Path, text: str) -> None:
    with open(path / "data.txt", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def fs_size(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def device_size(path: Path) -> int:
    with open(path, "rb") as f:
        return f.seek(0, os.SEEK_END)


async def claim(api: ApiClient, namespace: str, name: str) -> Obj:
    return await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)


async def resize(api: ApiClient, namespace: str, name: str, size: str) -> Obj:
    body = {"spec": {"resources": {"requests": {"storage": size}}}}
    return await api.patch(PERSISTENT_VOLUME_CLAIMS, name, body, namespace=namespace)


def status_of(pvc: Obj) -> Obj:
    return pvc.get("status") or {}


async def wait_capacity(api: ApiClient, namespace: str, name: str, size: str, timeout: float = 60) -> Obj:
    """Until the claim's status capacity is `size` with no resize in progress."""

    async def done() -> Obj | None:
        pvc = await claim(api, namespace, name)
        st = status_of(pvc)
        finished = st.get("capacity", {}).get("storage") == size and not rs.resize_status(pvc_view(pvc))
        return pvc if finished else None

    pvc: Obj = await eventually_async(f"claim {name} at {size}", done, timeout)
    return pvc


async def wait_resize_status(
    api: ApiClient, namespace: str, name: str, value: str, timeout: float = 60
) -> Obj:
    async def reached() -> Obj | None:
        pvc = await claim(api, namespace, name)
        return pvc if rs.resize_status(pvc_view(pvc)) == value else None

    pvc: Obj = await eventually_async(f"claim {name} resize status {value}", reached, timeout)
    return pvc


async def events_of(stack: StorageStack, namespace: str, reason: str, name: str) -> list[Obj]:
    return [e for e in await stack.events(namespace, reason) if e["involvedObject"]["name"] == name]


async def recorded(
    stack: StorageStack, namespace: str, reason: str, name: str, timeout: float = 30
) -> list[Obj]:
    """The events once there is one: each process posts its events after the status update that
    the test waited for, so on a loaded machine they arrive a moment later."""

    async def some() -> list[Obj] | None:
        return await events_of(stack, namespace, reason, name) or None

    events: list[Obj] = await eventually_async(f"a {reason} event for {name}", some, timeout)
    return events


async def test_online_expansion_of_a_mounted_xfs_volume(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=320, fs_type="xfs", class_name=EXPANDABLE)
    pod = await stack.pod(namespace, "app", "node-a", pvc)
    await stack.wait_running(namespace, "app")
    mount = stack.mount_path("node-a", pod, pv)
    write(mount, "before the resize")
    before = fs_size(mount)

    await resize(stack.api, namespace, pvc, "512Mi")
    done = await wait_capacity(stack.api, namespace, pvc, "512Mi")
    assert fs_size(mount) > before + 150 * MI, "statvfs of the pod's path shows the new size"
    assert (mount / "data.txt").read_text() == "before the resize"

    st = status_of(done)
    assert st["allocatedResources"] == {"storage": "512Mi"}
    assert not [c for c in st.get("conditions") or [] if c["type"] in rs.RESIZE_CONDITIONS]
    volume = await stack.api.get(PERSISTENT_VOLUMES, pv)
    assert volume["spec"]["capacity"]["storage"] == "512Mi"
    # Who said what, with the Go components' reasons, types, messages and sources.
    expanding = await recorded(stack, namespace, "ExternalExpanding", pvc)
    assert [(e["type"], e["message"], e["source"]["component"]) for e in expanding] == [
        ("Normal", "waiting for an external controller to expand this PVC", "volume_expand")
    ]
    (resizing,) = await recorded(stack, namespace, "Resizing", pvc)
    assert resizing["message"] == f"External resizer is resizing volume {pv}"
    assert resizing["source"]["component"] == f"external-resizer {DRIVER_NAME}"
    (required,) = await recorded(stack, namespace, "FileSystemResizeRequired", pvc)
    assert required["message"] == "Require file system resize of volume on node"
    for name in (pvc, "app"):
        (ok,) = await recorded(stack, namespace, "FileSystemResizeSuccessful", name)
        assert ok["type"] == "Normal"
        assert ok["message"] == f'MountVolume.NodeExpandVolume succeeded for volume "{pv}" node-a'

    await stack.delete_pod(namespace, "app")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_ext4_grows_online_or_at_the_next_mount(stack: StorageStack, namespace: str) -> None:
    """Online ext4 growth needs CAP_SYS_RESOURCE. Where the kernel refuses it, the driver answers
    FAILED_PRECONDITION and the node agent, like kubelet, leaves the volume to grow when it is next
    staged: the claim stays NodeResizeInProgress until a new pod mounts it."""
    pvc, pv, handle = await stack.volume(namespace, size_mi=128, class_name=EXPANDABLE)
    current = "first"
    pod = await stack.pod(namespace, current, "node-a", pvc)
    await stack.wait_running(namespace, current)
    mount = stack.mount_path("node-a", pod, pv)
    write(mount, "ext4 data")
    before = fs_size(mount)
    await resize(stack.api, namespace, pvc, "256Mi")
    if has_cap_sys_resource():
        await wait_capacity(stack.api, namespace, pvc, "256Mi")
        assert fs_size(mount) > before + 100 * MI
    else:

        async def refused() -> list[Obj]:
            return await events_of(stack, namespace, "FileSystemResizeFailed", "first")

        (event,) = await eventually_async("FileSystemResizeFailed on the pod", refused, 60)
        assert "CAP_SYS_RESOURCE" in event["message"]
        pending = await claim(stack.api, namespace, pvc)
        assert rs.resize_status(pvc_view(pending)) == rs.NODE_IN_PROGRESS  # as kubelet leaves it
        assert status_of(pending)["capacity"]["storage"] == "128Mi"
        await stack.delete_pod(namespace, current)
        current = "second"
        pod = await stack.pod(namespace, current, "node-a", pvc)
        await stack.wait_running(namespace, current)
        await wait_capacity(stack.api, namespace, pvc, "256Mi")
        mount = stack.mount_path("node-a", pod, pv)
        assert fs_size(mount) > before + 100 * MI
    assert (mount / "data.txt").read_text() == "ext4 data"
    await stack.delete_pod(namespace, current)
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_offline_expansion_then_a_pod(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=64, class_name=EXPANDABLE)
    pod = await stack.pod(namespace, "writer", "node-b", pvc)
    await stack.wait_running(namespace, "writer")
    write(stack.mount_path("node-b", pod, pv), "offline")
    await stack.delete_pod(namespace, "writer")
    await stack.assert_clean(handle)

    await resize(stack.api, namespace, pvc, "192Mi")
    pending = await wait_resize_status(stack.api, namespace, pvc, rs.NODE_PENDING)
    assert status_of(pending)["capacity"]["storage"] == "64Mi"
    conditions = {c["type"]: c for c in status_of(pending)["conditions"]}
    assert conditions[rs.FS_RESIZE_PENDING]["message"] == (
        "Waiting for user to (re-)start a pod to finish file system resize of volume on node."
    )
    assert (await stack.api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]["storage"] == "192Mi"

    pod = await stack.pod(namespace, "reader", "node-a", pvc)
    await stack.wait_running(namespace, "reader")
    await wait_capacity(stack.api, namespace, pvc, "192Mi")
    mount = stack.mount_path("node-a", pod, pv)
    assert fs_size(mount) > 150 * MI
    assert (mount / "data.txt").read_text() == "offline"
    await stack.delete_pod(namespace, "reader")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_block_volume_expansion(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=64, block=True, class_name=EXPANDABLE)
    pod = await stack.pod(namespace, "raw", "node-a", pvc, block=True)
    await stack.wait_running(namespace, "raw")
    device = stack.device_path("node-a", pod, pv)
    assert device_size(device) == 64 * MI
    await resize(stack.api, namespace, pvc, "96Mi")
    await wait_capacity(stack.api, namespace, pvc, "96Mi")
    assert device_size(device) == 96 * MI, "the pod's device has the new size"
    await stack.delete_pod(namespace, "raw")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_the_apiserver_refuses_a_shrink_and_a_class_without_expansion(
    stack: StorageStack, namespace: str
) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=64, class_name=EXPANDABLE)
    with pytest.raises(ApiError) as shrink:
        await resize(stack.api, namespace, pvc, "32Mi")
    assert shrink.value.status == 422
    assert "spec.resources.requests.storage: Forbidden: field can not be less than status.capacity" in str(
        shrink.value
    )
    fixed, fixed_pv, fixed_handle = await stack.volume(namespace, size_mi=64, class_name=FIXED)
    with pytest.raises(ApiError) as refused:
        await resize(stack.api, namespace, fixed, "128Mi")
    assert refused.value.status == 403
    assert (
        "only dynamically provisioned pvc can be resized and the storageclass that provisions the pvc "
        "must support resize"
    ) in str(refused.value)
    for c, v, h in ((pvc, pv, handle), (fixed, fixed_pv, fixed_handle)):
        await stack.delete_volume(namespace, c, v, h)


async def test_pool_cannot_hold_it_then_the_user_asks_for_less(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=64, class_name=EXPANDABLE)
    too_big = f"{shutil.disk_usage(stack.pool).free // (1 << 30) + 16}Gi"  # more than the pool has
    await resize(stack.api, namespace, pvc, too_big)
    failed = await wait_resize_status(stack.api, namespace, pvc, rs.CONTROLLER_INFEASIBLE)
    conditions = {c["type"]: c for c in status_of(failed)["conditions"]}
    assert conditions[rs.CONTROLLER_RESIZE_ERROR]["message"].startswith(
        "failed to expand pvc with rpc error: code = OutOfRange desc = not enough space"
    )
    assert status_of(failed)["allocatedResources"] == {"storage": too_big}

    async def failures() -> list[Obj]:
        return await events_of(stack, namespace, "VolumeResizeFailed", pvc)

    (event,) = await eventually_async("VolumeResizeFailed", failures, 30)
    assert event["type"] == "Warning"
    assert event["message"].startswith(
        f'resize volume "{pv}" by resizer "{DRIVER_NAME}" failed: rpc error: code = OutOfRange desc = '
    )

    async def not_hammered() -> list[str]:
        counts = [e.get("count", 1) for e in await failures()]
        capacity = (await stack.api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]["storage"]
        return ([f"VolumeResizeFailed counts {counts}"] if counts != [1] else []) + (
            [f"capacity {capacity}"] if capacity != "64Mi" else []
        )

    # An infeasible size is not hammered: retried once per --retry-interval-max.
    await consistently_async(
        "one VolumeResizeFailed, the PV at 64Mi", not_hammered, 3, 0.2, satisfied=no_problems
    )

    # Recovery from expansion failure: any size above the status capacity, below the failed one.
    await resize(stack.api, namespace, pvc, "128Mi")
    pending = await wait_resize_status(stack.api, namespace, pvc, rs.NODE_PENDING)
    assert status_of(pending)["allocatedResources"] == {"storage": "128Mi"}
    kinds = {c["type"] for c in status_of(pending)["conditions"]}
    assert rs.CONTROLLER_RESIZE_ERROR not in kinds and rs.FS_RESIZE_PENDING in kinds
    assert (await stack.api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]["storage"] == "128Mi"
    pod = await stack.pod(namespace, "after", "node-a", pvc)
    await stack.wait_running(namespace, "after")
    await wait_capacity(stack.api, namespace, pvc, "128Mi")
    assert fs_size(stack.mount_path("node-a", pod, pv)) > 100 * MI
    await stack.delete_pod(namespace, "after")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_fifty_claims_resized_at_once_one_operation_each(stack: StorageStack, namespace: str) -> None:
    """Block volumes that no pod uses need no node step: the resizer finishes them itself."""
    volumes: list[tuple[str, str, str]] = []
    for _batch in range(5):
        volumes += await asyncio.gather(
            *(stack.volume(namespace, size_mi=8, block=True, class_name=EXPANDABLE) for _ in range(10))
        )
    await asyncio.gather(*(resize(stack.api, namespace, pvc, "16Mi") for pvc, _, _ in volumes))

    async def all_done() -> bool:
        items, _ = await stack.api.list_all(PERSISTENT_VOLUME_CLAIMS, namespace)
        return all(status_of(c).get("capacity", {}).get("storage") == "16Mi" for c in items)

    await eventually_async("50 claims at 16Mi", all_done, 120, 0.5)
    for pvc, pv, handle in volumes:
        done = await claim(stack.api, namespace, pvc)
        assert not rs.resize_status(pvc_view(done))
        assert done["metadata"]["annotations"][rs.NODE_EXPANSION_NOT_REQUIRED] == "true"
        assert (await stack.api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]["storage"] == "16Mi"
        assert (stack.pool / "volumes" / f"{handle}.img").stat().st_size == 16 * MI

    async def resizing_per_claim() -> dict[str, int] | None:
        # Events trail the status writes (the resizer's client is held to --kube-api-qps 5).
        counts: dict[str, int] = {}
        for e in await stack.events(namespace, "Resizing"):
            name = e["involvedObject"]["name"]
            counts[name] = counts.get(name, 0) + e.get("count", 1)
        successes = await stack.events(namespace, "VolumeResizeSuccessful")
        return counts if len(counts) == 50 and len(successes) == 50 else None

    per_claim = await eventually_async("an event for each of the 50 claims", resizing_per_claim, 120, 1)
    assert per_claim == {pvc: 1 for pvc, _, _ in volumes}, "one ControllerExpandVolume per volume"
    for pvc, pv, handle in volumes:
        await stack.delete_volume(namespace, pvc, pv, handle)


@pytest.mark.parametrize("victim", ["external-resizer", "node-agent-node-a"])
async def test_kill9_during_expansion_converges(stack: StorageStack, namespace: str, victim: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=320, fs_type="xfs", class_name=EXPANDABLE)
    pod = await stack.pod(namespace, "app", "node-a", pvc)
    await stack.wait_running(namespace, "app")
    mount = stack.mount_path("node-a", pod, pv)
    write(mount, victim)
    before = fs_size(mount)
    if victim.startswith("node-agent"):
        # Dead while the resizer hands the volume over; its successor finds the claim pending.
        await stack.kill9(victim, restart=False)
        await resize(stack.api, namespace, pvc, "448Mi")
        await wait_resize_status(stack.api, namespace, pvc, rs.NODE_PENDING, timeout=30)
        await stack.process(victim).start()
    else:
        await resize(stack.api, namespace, pvc, "448Mi")
        await stack.kill9(victim)
    await wait_capacity(stack.api, namespace, pvc, "448Mi", timeout=90)
    assert fs_size(mount) > before + 100 * MI and (mount / "data.txt").read_text() == victim
    assert (await stack.api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]["storage"] == "448Mi"
    assert (stack.pool / "volumes" / f"{handle}.img").stat().st_size == 448 * MI
    await stack.delete_pod(namespace, "app")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)
