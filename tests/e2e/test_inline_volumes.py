"""CSI ephemeral inline volumes end to end: a pod with a `csi:` volume on the real apiserver, the
node agent doing what kubelet does for it (NodePublishVolume with the pod's information, no
attach, no stage), the real driver making the volume in the node's pool; the pod's data lives on
a real filesystem, and once the pod is gone so is the backing file. The pool offers 1Gi
(`--capacity`), which inline volumes take from as persistent volumes do."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient
from controller_runtime.resources import NODES, PODS, VOLUME_ATTACHMENTS, Obj
from csi_driver import DRIVER_NAME
from localstack.controlplane import ControlPlane
from localstack.pools import PoolCapacity
from localstack.storage_stack import STORAGE_COMPONENTS, StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    s = StorageStack(control_plane, api, STORAGE_COMPONENTS, pool_capacity=PoolCapacity(default="1Gi"))
    try:
        await s.start()
        yield s
    finally:
        await s.stop()


async def inline_pod(stack: StorageStack, namespace: str, name: str, attributes: dict[str, str]) -> Obj:
    return await stack.api.create(
        PODS,
        {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": "node-a",
                "terminationGracePeriodSeconds": 30,
                "containers": [
                    {
                        "name": "app",
                        "image": "registry.k8s.io/pause:3.10",
                        "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}],
                    }
                ],
                "volumes": [
                    {"name": "scratch", "csi": {"driver": DRIVER_NAME, "volumeAttributes": attributes}}
                ],
            },
        },
    )


def backing_file(stack: StorageStack, pod: Obj) -> Path:
    handle = "csi-" + hashlib.sha256(f"{pod['metadata']['uid']}scratch".encode()).hexdigest()
    return stack.pool / "ephemeral" / f"{handle}.img"


async def test_a_pods_inline_volume_holds_data_and_goes_with_the_pod(
    stack: StorageStack, namespace: str
) -> None:
    pod = await inline_pod(stack, namespace, "app", {"size": "48Mi"})
    await stack.wait_running(namespace, "app")
    mount = stack.mount_path("node-a", pod, "scratch")
    write(mount, "scratch data")
    backing = backing_file(stack, pod)
    assert backing.stat().st_size == 48 << 20
    # Nothing to attach and nothing in use for an attach: no VolumeAttachment, no volumesInUse.
    attachments, _ = await stack.api.list_all(VOLUME_ATTACHMENTS)
    assert not [va for va in attachments if va["spec"]["source"].get("persistentVolumeName") is None]
    node = await stack.api.get(NODES, "node-a")
    assert not [v for v in node["status"].get("volumesInUse") or [] if backing.stem in v]
    await stack.delete_pod(namespace, "app")
    await eventually_async("the inline volume's backing file removed", lambda: _gone(backing), 30)
    assert not stack.mounts(), "a mount of the inline volume is left"


async def _gone(path: Path) -> bool:
    return not await asyncio.to_thread(path.exists)


def write(path: Path, text: str) -> None:
    with open(path / "data.txt", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


async def test_an_inline_volume_the_node_cannot_hold_fails_the_mount_and_leaves_nothing(
    stack: StorageStack, namespace: str
) -> None:
    pod = await inline_pod(stack, namespace, "greedy", {"size": "900Ti"})

    (event, *_) = await eventually_async(
        "a FailedMount event", lambda: failed_mount(stack, namespace, "greedy"), 60
    )
    assert event["type"] == "Warning"
    assert event["message"].startswith('MountVolume.SetUp failed for volume "scratch" : rpc error: code = ')
    assert "maximum volume size" in event["message"] or "free in its pool" in event["message"]
    current = await stack.api.get(PODS, "greedy", namespace)
    assert current["status"].get("phase") == "Pending"
    await stack.delete_pod(namespace, "greedy")
    assert not backing_file(stack, pod).exists()
    assert not list((stack.pool / "ephemeral").iterdir())


async def failed_mount(stack: StorageStack, namespace: str, pod: str) -> list[Obj] | None:
    events = await stack.events(namespace, "FailedMount")
    return [e for e in events if e["involvedObject"]["name"] == pod] or None


async def test_an_inline_volume_outside_the_capacity_waits_with_a_clear_event_until_room_is_freed(
    stack: StorageStack, namespace: str
) -> None:
    pvc, pv, handle = await stack.volume(namespace, size_mi=768)
    pod = await inline_pod(stack, namespace, "crowded", {"size": "384Mi"})
    (event, *_) = await eventually_async(
        "a FailedMount event", lambda: failed_mount(stack, namespace, "crowded"), 60
    )
    assert event["type"] == "Warning"
    assert event["message"] == (
        'MountVolume.SetUp failed for volume "scratch" : rpc error: code = ResourceExhausted desc = '
        "node node-a cannot make an inline volume of 384Mi: the pool's --capacity 1Gi has 256Mi left "
        "(768Mi held by persistent volumes and snapshots, 0B by inline volumes)"
    )
    assert (await stack.api.get(PODS, "crowded", namespace))["status"].get("phase") == "Pending"
    assert not backing_file(stack, pod).exists()
    # The persistent volume goes: the node agent's next try finds the room.
    await stack.delete_volume(namespace, pvc, pv, handle)
    await stack.wait_running(namespace, "crowded", timeout=150)
    assert backing_file(stack, pod).stat().st_size == 384 << 20
    await stack.delete_pod(namespace, "crowded")
    await eventually_async(
        "the inline volume's backing file removed", lambda: _gone(backing_file(stack, pod)), 30
    )
    assert not list((stack.pool / "ephemeral").iterdir())
