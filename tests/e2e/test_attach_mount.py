"""Attach, mount, unmount and detach end to end: the real control plane, kubeloop's processes and
the real CSI driver on loop devices. Each test checks data on the volume, not only API objects."""

from __future__ import annotations

import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import PODS, Resource
from localstack.controlplane import ControlPlane
from localstack.storage_stack import StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    s = StorageStack(control_plane, api)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


def write(path: Path, text: str) -> None:
    with open(path / "data.txt", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


async def test_mount_write_unmount_and_move_to_other_node(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace)
    pod = await stack.pod(namespace, "writer", "node-a", pvc)
    await stack.wait_running(namespace, "writer")
    va = await stack.va(handle, "node-a")
    assert va is not None and va["status"]["attached"] is True
    assert va["spec"]["source"]["persistentVolumeName"] == pv
    assert stack.loop_devices(handle), "the volume is staged on a loop device"
    mount = stack.mount_path("node-a", pod, pv)
    assert str(mount) in stack.mounts()
    assert (mount.parent / "vol_data.json").exists()
    write(mount, "written on node-a")
    assert await stack.events(namespace, "SuccessfulAttachVolume")

    await stack.delete_pod(namespace, "writer")
    await stack.assert_clean(handle)
    assert not mount.exists(), "the pod's volume directory is removed"

    # The same claim on the other node: detached from node-a (above), attached to node-b.
    pod_b = await stack.pod(namespace, "reader", "node-b", pvc)
    await stack.wait_running(namespace, "reader")
    assert await stack.va(handle, "node-a") is None
    assert (stack.mount_path("node-b", pod_b, pv) / "data.txt").read_text() == "written on node-a"
    await stack.delete_pod(namespace, "reader")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_multi_attach_refused_until_first_pod_leaves(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace)
    await stack.pod(namespace, "first", "node-a", pvc)
    await stack.wait_running(namespace, "first")
    second = await stack.pod(namespace, "second", "node-b", pvc)

    async def multi_attach() -> bool:
        events = await stack.events(namespace, "FailedAttachVolume")
        return any(e["involvedObject"]["name"] == "second" for e in events)

    await eventually_async("a Multi-Attach event on the second pod", multi_attach, 20)
    events = [
        e
        for e in await stack.events(namespace, "FailedAttachVolume")
        if e["involvedObject"]["name"] == "second"
    ]
    # kcm names the pod that holds the volume when it is in the same namespace.
    used_by = "Volume is already used by pod(s) first"
    assert events[0]["message"] == f'Multi-Attach error for volume "{pv}" {used_by}'
    assert len(events) == 1 and events[0].get("count", 1) == 1, "reported once"
    assert await stack.va(handle, "node-b") is None
    pod = await stack.api.get(*_pod_path(namespace, "second"))
    assert pod.get("status", {}).get("phase") != "Running"

    await stack.delete_pod(namespace, "first")
    await stack.wait_running(namespace, "second")
    assert (await stack.va(handle, "node-b") or {}).get("status", {}).get("attached") is True
    assert await stack.va(handle, "node-a") is None
    assert str(stack.mount_path("node-b", second, pv)) in stack.mounts()
    await stack.delete_pod(namespace, "second")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_read_only_many_on_both_nodes(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, modes=("ReadOnlyMany",))
    pods = [await stack.pod(namespace, f"ro-{n}", n, pvc, read_only=True) for n in ("node-a", "node-b")]
    for n in ("node-a", "node-b"):
        await stack.wait_running(namespace, f"ro-{n}")
        assert (await stack.va(handle, n) or {}).get("status", {}).get("attached") is True
    for pod, n in zip(pods, ("node-a", "node-b"), strict=True):
        mount = stack.mount_path(n, pod, pv)
        with pytest.raises(OSError):
            write(mount, "must fail: read-only")
    assert not await stack.events(namespace, "FailedAttachVolume")
    for n in ("node-a", "node-b"):
        await stack.delete_pod(namespace, f"ro-{n}")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def test_block_volume(stack: StorageStack, namespace: str) -> None:
    pvc, pv, handle = await stack.volume(namespace, block=True)
    pod = await stack.pod(namespace, "blk", "node-a", pvc, block=True)
    await stack.wait_running(namespace, "blk")
    dev = stack.device_path("node-a", pod, pv)
    payload = b"kubeloop-block".ljust(4096, b"\0")
    fd = os.open(dev, os.O_RDWR)
    try:
        os.pwrite(fd, payload, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    await stack.delete_pod(namespace, "blk")
    await stack.assert_clean(handle)
    pod_b = await stack.pod(namespace, "blk2", "node-b", pvc, block=True)
    await stack.wait_running(namespace, "blk2")
    fd = os.open(stack.device_path("node-b", pod_b, pv), os.O_RDONLY)
    try:
        assert os.pread(fd, 4096, 0) == payload
    finally:
        os.close(fd)
    await stack.delete_pod(namespace, "blk2")
    await stack.assert_clean(handle)
    await stack.delete_volume(namespace, pvc, pv, handle)


def _pod_path(namespace: str, name: str) -> tuple[Resource, str, str]:
    return (PODS, name, namespace)


@pytest.mark.parametrize(
    "victim",
    ["attach-detach-controller", "external-attacher", "node-agent", "csi-driver-node"],
)
async def test_kill9_during_attach_mount_and_detach_unmount(
    stack: StorageStack, namespace: str, victim: str
) -> None:
    """SIGKILL the victim right when the volume is being attached/mounted, and again while it is
    being unmounted/detached; it is restarted like a supervisor would. Everything must converge:
    pod running, data intact, then no VolumeAttachment, loop device or mount left."""
    pvc, pv, handle = await stack.volume(namespace)
    node_side = victim in ("node-agent", "csi-driver-node")
    for round_, node in enumerate(("node-a", "node-b")):
        name = f"{victim}-{round_}"
        instance = f"{victim}-{node}" if node_side else victim
        pod = await stack.pod(namespace, name, node, pvc)

        async def attaching(node: str = node) -> bool:
            va = await stack.va(handle, node)
            return va is not None and (not node_side or bool(va.get("status", {}).get("attached")))

        await eventually_async("the attach to begin", attaching, 30, 0.02)
        await stack.kill9(instance)
        await stack.wait_running(namespace, name, timeout=90)
        mount = stack.mount_path(node, pod, pv)
        if round_ == 1:
            assert (mount / "data.txt").read_text() == "round 0", "data written before the crashes is intact"
        write(mount, f"round {round_}")

        await stack.api.delete(*_pod_path(namespace, name))
        if node_side:
            await stack.kill9(instance)  # in the middle of unmount/unstage
        else:

            async def unmounted(mount: Path = mount) -> bool:
                return str(mount) not in stack.mounts()

            await eventually_async("the unmount", unmounted, 30, 0.02)
            await stack.kill9(instance)  # in the middle of detach
        await eventually_async(f"pod {name} gone", functools.partial(_pod_gone, stack, namespace, name), 90)
        await stack.assert_clean(handle, timeout=90)
    await stack.delete_volume(namespace, pvc, pv, handle)


async def _pod_gone(stack: StorageStack, namespace: str, name: str) -> bool:
    try:
        await stack.api.get(*_pod_path(namespace, name))
        return False
    except ApiError as exc:
        return exc.not_found
