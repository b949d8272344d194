"""VolumeAttributesClass end to end on the real apiserver: kubeloop's external-provisioner passes a
class's parameters to CreateVolume, the pv-controller records the class a claim binds with, and the
external-resizer's modify controller changes a live volume's class with ControllerModifyVolume.
Each step is checked on the volume itself: `cacheMode: writethrough` is the backing file's
synchronous-write flag, read while a pod has the volume mounted."""

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
    VOLUME_ATTRIBUTES_CLASSES,
    Obj,
)
from csi_driver import DRIVER_NAME
from csi_driver.backend.files import synchronous
from localstack.controlplane import ControlPlane
from localstack.storage_stack import STORAGE_COMPONENTS, StorageStack
from tests.support.waits import eventually_async

pytestmark = [pytest.mark.integration, pytest.mark.root]

COMPONENTS = (*STORAGE_COMPONENTS, "external-provisioner", "external-resizer")
CLASS = "kubeloop-e2e-vac"
WRITEBACK = "kubeloop-e2e-writeback"
WRITETHROUGH = "kubeloop-e2e-writethrough"
UNKNOWN_KEY = "kubeloop-e2e-iops"
LATER = "kubeloop-e2e-later"
FOREIGN = "kubeloop-e2e-foreign"
VACS: dict[str, tuple[str, dict[str, str]]] = {
    WRITEBACK: (DRIVER_NAME, {"cacheMode": "writeback"}),
    WRITETHROUGH: (DRIVER_NAME, {"cacheMode": "writethrough"}),
    UNKNOWN_KEY: (DRIVER_NAME, {"iops": "3000"}),
    FOREIGN: ("ebs.csi.aws.com", {"type": "gp3"}),
}


async def _delete(api: ApiClient, res: object, name: str) -> None:
    try:
        await api.delete(res, name)  # type: ignore[arg-type]
    except ApiError as exc:
        if not exc.not_found:
            raise


async def create_vac(api: ApiClient, name: str, driver: str, params: dict[str, str]) -> None:
    await _delete(api, VOLUME_ATTRIBUTES_CLASSES, name)
    body = {"metadata": {"name": name}, "driverName": driver, "parameters": params}
    await api.create(VOLUME_ATTRIBUTES_CLASSES, body)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(control_plane: ControlPlane, api: ApiClient) -> AsyncIterator[StorageStack]:
    await _delete(api, STORAGE_CLASSES, CLASS)
    await api.create(STORAGE_CLASSES, {"metadata": {"name": CLASS}, "provisioner": DRIVER_NAME})
    for name, (driver, params) in VACS.items():
        await create_vac(api, name, driver, params)
    s = StorageStack(control_plane, api, COMPONENTS)
    try:
        await s.start()
        yield s
    finally:
        await s.stop()
        await _delete(api, STORAGE_CLASSES, CLASS)
        for name in (*VACS, LATER):
            await _delete(api, VOLUME_ATTRIBUTES_CLASSES, name)


async def claim(api: ApiClient, namespace: str, name: str) -> Obj:
    return await api.get(PERSISTENT_VOLUME_CLAIMS, name, namespace)


async def new_claim(stack: StorageStack, namespace: str, vac: str) -> str:
    name = f"vac-{uuid.uuid4().hex[:6]}"
    await stack.api.create(
        PERSISTENT_VOLUME_CLAIMS,
        {
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "storageClassName": CLASS,
                "volumeAttributesClassName": vac,
                "resources": {"requests": {"storage": "64Mi"}},
            },
        },
        namespace,
    )
    return name


async def bound(stack: StorageStack, namespace: str, name: str) -> Obj:
    async def done() -> Obj | None:
        pvc = await claim(stack.api, namespace, name)
        return pvc if (pvc.get("status") or {}).get("phase") == "Bound" else None

    pvc: Obj = await eventually_async(f"claim {name} bound", done, 60)
    return pvc


async def set_class(api: ApiClient, namespace: str, name: str, vac: str) -> None:
    body = {"spec": {"volumeAttributesClassName": vac}}
    await api.patch(PERSISTENT_VOLUME_CLAIMS, name, body, namespace=namespace)


async def settled_on(api: ApiClient, namespace: str, name: str, vac: str, timeout: float = 60) -> Obj:
    """Until the claim's volume has class `vac` and no modification is under way."""

    async def done() -> Obj | None:
        pvc = await claim(api, namespace, name)
        st = pvc.get("status") or {}
        ok = st.get("currentVolumeAttributesClassName") == vac and "modifyVolumeStatus" not in st
        return pvc if ok else None

    pvc: Obj = await eventually_async(f"claim {name} on class {vac}", done, timeout)
    return pvc


async def modify_status(api: ApiClient, namespace: str, name: str, state: str) -> Obj:
    async def reached() -> Obj | None:
        pvc = await claim(api, namespace, name)
        mvs = (pvc.get("status") or {}).get("modifyVolumeStatus") or {}
        return pvc if mvs.get("status") == state else None

    pvc: Obj = await eventually_async(f"claim {name} modification {state}", reached, 60)
    return pvc


async def events(stack: StorageStack, namespace: str, reason: str, name: str) -> list[Obj]:
    async def some() -> list[Obj] | None:
        found = [e for e in await stack.events(namespace, reason) if e["involvedObject"]["name"] == name]
        return found or None

    found: list[Obj] = await eventually_async(f"a {reason} event for {name}", some, 30)
    return found


def conditions(pvc: Obj) -> dict[str, Obj]:
    return {c["type"]: c for c in (pvc.get("status") or {}).get("conditions") or []}


async def backing_file(stack: StorageStack, pv: str) -> str:
    volume = await stack.api.get(PERSISTENT_VOLUMES, pv)
    handle = volume["spec"]["csi"]["volumeHandle"]
    return str(stack.pool / "volumes" / f"{handle}.img")


def write(path: Path, text: str) -> None:
    with open(path / "data.txt", "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


async def test_a_live_volume_changes_class_and_an_infeasible_class_is_rolled_back(
    stack: StorageStack, namespace: str
) -> None:
    api = stack.api
    name = await new_claim(stack, namespace, WRITEBACK)
    pvc = await bound(stack, namespace, name)
    pv = pvc["spec"]["volumeName"]
    # The provisioner's PV names the class; the pv-controller records it as current on binding.
    assert (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["volumeAttributesClassName"] == WRITEBACK
    pvc = await settled_on(api, namespace, name, WRITEBACK, timeout=30)
    path = await backing_file(stack, pv)
    assert not synchronous(path)

    pod = await stack.pod(namespace, "app", "node-a", name)
    await stack.wait_running(namespace, "app")
    mount = stack.mount_path("node-a", pod, pv)
    write(mount, "written through writeback")

    # To writethrough while the pod runs: the flag is on the file its loop device is bound to.
    await set_class(api, namespace, name, WRITETHROUGH)
    pvc = await settled_on(api, namespace, name, WRITETHROUGH)
    assert synchronous(path), "the live volume did not become writethrough"
    assert not {"ModifyingVolume", "ModifyVolumeError"} & set(conditions(pvc))
    assert (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["volumeAttributesClassName"] == WRITETHROUGH
    (modifying,) = await events(stack, namespace, "VolumeModify", name)
    assert modifying["type"] == "Normal"
    assert modifying["message"] == f"external resizer is modifying volume {name} with vac {WRITETHROUGH}"
    assert modifying["source"]["component"] == f"external-resizer {DRIVER_NAME}"
    (succeeded,) = await events(stack, namespace, "VolumeModifySuccessful", name)
    assert (
        succeeded["message"]
        == f"external resizer modified volume {name} with vac {WRITETHROUGH} successfully"
    )
    assert (mount / "data.txt").read_text() == "written through writeback"
    write(mount, "written through writethrough")

    # A class the driver cannot apply: Infeasible, and the volume stays as it was.
    await set_class(api, namespace, name, UNKNOWN_KEY)
    pvc = await modify_status(api, namespace, name, "Infeasible")
    st = pvc["status"]
    assert st["currentVolumeAttributesClassName"] == WRITETHROUGH
    assert st["modifyVolumeStatus"]["targetVolumeAttributesClassName"] == UNKNOWN_KEY
    error = conditions(pvc)["ModifyVolumeError"]
    assert error["reason"] == "InvalidArgument" and "unknown parameter 'iops'" in error["message"]
    assert conditions(pvc)["ModifyingVolume"]["message"] == (
        f'Modifying volume to "{UNKNOWN_KEY}" failed. Waiting for retry.'
    )
    failed = await events(stack, namespace, "VolumeModifyFailed", name)
    assert failed[0]["type"] == "Warning"
    assert failed[0]["message"].startswith("rpc error: code = InvalidArgument desc = ")
    assert (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["volumeAttributesClassName"] == WRITETHROUGH
    assert synchronous(path)

    # Rolled back to the current class: the modification ends and the error goes.
    await set_class(api, namespace, name, WRITETHROUGH)
    pvc = await settled_on(api, namespace, name, WRITETHROUGH)
    assert not {"ModifyingVolume", "ModifyVolumeError"} & set(conditions(pvc))
    assert synchronous(path)
    assert (mount / "data.txt").read_text() == "written through writethrough"

    # A class that does not exist yet: Pending, then applied as soon as it is created.
    await set_class(api, namespace, name, LATER)
    pvc = await modify_status(api, namespace, name, "Pending")
    assert pvc["status"]["currentVolumeAttributesClassName"] == WRITETHROUGH

    async def missing() -> list[Obj] | None:
        failed = await stack.events(namespace, "VolumeModifyFailed")
        return [e for e in failed if e["message"] == f'VAC "{LATER}" does not exist.'] or None

    (absent,) = await eventually_async("the event naming the missing class", missing, 30)
    assert absent["type"] == "Warning"
    await create_vac(api, LATER, DRIVER_NAME, {"cacheMode": "writeback"})
    await settled_on(api, namespace, name, LATER, timeout=30)
    assert not synchronous(path)

    await stack.delete_pod(namespace, "app")
    await api.delete(PERSISTENT_VOLUME_CLAIMS, name, namespace)


async def test_a_claim_naming_another_drivers_class_is_not_provisioned(
    stack: StorageStack, namespace: str
) -> None:
    name = await new_claim(stack, namespace, FOREIGN)
    (failed, *_) = await events(stack, namespace, "ProvisioningFailed", name)
    assert failed["message"] == (
        f"VAC {FOREIGN} referenced in PVC is for driver ebs.csi.aws.com which does not match driver name "
        f"{DRIVER_NAME}"
    )
    assert (await claim(stack.api, namespace, name))["status"]["phase"] == "Pending"
    assert not (await claim(stack.api, namespace, name))["spec"].get("volumeName")
    await stack.api.delete(PERSISTENT_VOLUME_CLAIMS, name, namespace)
