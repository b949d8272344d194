"""external-provisioner against the real apiserver, kube-scheduler and CSI driver: claims become
Bound to new PVs backed by files of the right size; deleting a claim deletes both (Retain keeps
both); WaitForFirstConsumer follows the scheduler's node; clones copy the source."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from controller_runtime import storage
from controller_runtime.client import ApiClient, ApiError
from controller_runtime.resources import (
    CSI_NODES,
    CSI_STORAGE_CAPACITIES,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    STORAGE_CLASSES,
    Obj,
)
from controller_runtime.toolchain import REPO_ROOT
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from external_provisioner import names
from localstack.controlplane import ControlPlane
from tests.support.waits import consistently_async, eventually_async, no_problems

from .pods import create_pod, force_delete_pods
from .provisioner_harness import create_topology_node, harness, kubectl

pytestmark = pytest.mark.integration

MiB = 1 << 20


async def test_default_class_binds_a_new_volume_and_deleting_the_claim_deletes_it(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        await kubectl(control_plane, "apply", "-f", str(REPO_ROOT / "deploy/storageclasses.yaml"))
        try:
            claim = await h.create_pvc("data", "100Mi")  # no class: admission picks the default
            t0 = asyncio.get_running_loop().time()
            pv = (await h.bound("data", timeout=10))["data"]
            took = asyncio.get_running_loop().time() - t0
            assert took < 10
            uid = claim["metadata"]["uid"]
            assert pv["metadata"]["name"] == f"pvc-{uid}"
            assert pv["metadata"]["annotations"][storage.ANN_PROVISIONED_BY] == DRIVER_NAME
            assert names.PV_FINALIZER in pv["metadata"]["finalizers"]
            spec = pv["spec"]
            assert spec["claimRef"]["uid"] == uid and spec["claimRef"]["name"] == "data"
            assert spec["storageClassName"] == "kubeloop"
            assert spec["persistentVolumeReclaimPolicy"] == "Delete"
            assert spec["volumeMode"] == "Filesystem"
            assert spec["capacity"]["storage"] == "100Mi"
            assert spec["accessModes"] == ["ReadWriteOnce"]
            csi = spec["csi"]
            assert csi["driver"] == DRIVER_NAME and csi["fsType"] == "ext4"
            assert csi["volumeAttributes"][names.PROVISIONER_IDENTITY].endswith(DRIVER_NAME)
            backing = h.root / "pool" / "volumes" / f"{csi['volumeHandle']}.img"
            assert backing.stat().st_size == 100 * MiB
            await h.wait_event("data", names.PROVISIONING, f'for claim "{namespace}/data"')
            await h.wait_event(
                "data",
                names.PROVISIONING_SUCCEEDED,
                f"Successfully provisioned volume {pv['metadata']['name']}",
            )
            await h.assert_files_equal_pvs()

            await api.delete(PERSISTENT_VOLUME_CLAIMS, "data", namespace)

            async def gone() -> list[str]:
                problems = []
                if await h.pv(pv["metadata"]["name"]) is not None:
                    problems.append("PV still there")
                if backing.exists():
                    problems.append("backing file still there")
                return problems

            await eventually_async("gone", gone, 20, satisfied=no_problems, context=h.log_tail)
        finally:
            with contextlib.suppress(ApiError):
                await kubectl(control_plane, "delete", "-f", str(REPO_ROOT / "deploy/storageclasses.yaml"))


async def test_block_and_filesystem_mount_options_fstype_and_retain(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        cls = await h.create_class(
            "retain",
            parameters={"csi.storage.k8s.io/fstype": "ext3"},
            mountOptions=["noatime", "nodiratime"],
            reclaimPolicy="Retain",
        )
        await h.create_pvc("fs", "32Mi", cls)
        await h.create_pvc("raw", "48Mi", cls, block=True, modes=("ReadWriteOncePod",))
        pvs = await h.bound("fs", "raw")
        fs, raw = pvs["fs"]["spec"], pvs["raw"]["spec"]
        assert fs["csi"]["fsType"] == "ext3" and fs["mountOptions"] == ["noatime", "nodiratime"]
        assert fs["volumeMode"] == "Filesystem" and fs["persistentVolumeReclaimPolicy"] == "Retain"
        assert "fsType" not in raw["csi"] and raw["volumeMode"] == "Block"
        assert raw["accessModes"] == ["ReadWriteOncePod"]
        for pv in pvs.values():
            assert names.PV_FINALIZER not in (pv["metadata"].get("finalizers") or [])
        assert (h.root / "pool" / "volumes" / f"{raw['csi']['volumeHandle']}.img").stat().st_size == 48 * MiB
        await h.assert_files_equal_pvs()

        await h.delete_claims()

        async def released() -> list[str]:
            return [
                f"{p['metadata']['name']}: {p.get('status', {}).get('phase')}"
                for p in await h.pvs()
                if p.get("status", {}).get("phase") != "Released"
            ]

        await eventually_async("released", released, 20, satisfied=no_problems)

        async def both_kept() -> int:
            return len(await h.pvs())

        # The provisioner has every chance to (wrongly) delete them.
        await consistently_async("the two Released PVs kept", both_kept, 1, satisfied=lambda n: n == 2)
        await h.assert_files_equal_pvs(timeout=0)


async def test_wait_for_first_consumer_follows_the_scheduler(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    node = f"{namespace}-node"
    async with harness(control_plane, api, namespace) as h:
        await create_topology_node(api, node)
        try:
            cls = await h.create_class(
                "wffc", volumeBindingMode="WaitForFirstConsumer", allowVolumeExpansion=True
            )
            await h.create_pvc("data", "16Mi", cls)
            await consistently_async(
                "nothing provisioned before a consumer exists", h.pvs, 1, satisfied=no_problems
            )
            await create_pod(api, namespace, "app", "data")
            pv = (await h.bound("data", timeout=60))["data"]
            terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
            assert terms == [
                {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [node]}]}
            ]
            claim = await h.pvc("data")
            assert claim is not None and claim["metadata"]["annotations"][storage.ANN_SELECTED_NODE] == node

            # Capacity: one object per WaitForFirstConsumer class and node segment.
            from controller_runtime.csi_client import CSIConnection
            from controller_runtime.informer import SharedInformerFactory
            from external_provisioner.capacity import CapacityOptions, CapacityPublisher

            assert h.driver is not None
            conn = await CSIConnection.connect(h.driver.endpoint, wait=10)
            factory = SharedInformerFactory(api)
            publisher = CapacityPublisher(
                api,
                conn,
                factory.informer(STORAGE_CLASSES),
                factory.informer(CSI_NODES),
                factory.informer(NODES),
                CapacityOptions(namespace=namespace),
            )
            factory.start()

            async def mine(class_name: str) -> list[Obj]:
                items = (await api.list_page(CSI_STORAGE_CAPACITIES, namespace))["items"]
                # Other tests' nodes may share this control plane: look at this test's node only.
                return [
                    i
                    for i in items
                    if i["storageClassName"] == class_name
                    and i["nodeTopology"] == {"matchLabels": {TOPOLOGY_KEY: node}}
                ]

            try:
                await factory.wait_for_sync(10)
                await publisher.refresh()
                await publisher.refresh()  # idempotent: still one object
                objects = await mine(cls)
                assert len(objects) == 1, objects
                assert objects[0]["metadata"]["labels"][names.CAPACITY_LABEL_DRIVER] == DRIVER_NAME
                assert int(objects[0]["capacity"].rstrip("Ki").rstrip("MGT") or 0) > 0

                # A class created later is published at once, not at the next poll (an hour here).
                slow = CapacityPublisher(
                    api,
                    conn,
                    factory.informer(STORAGE_CLASSES),
                    factory.informer(CSI_NODES),
                    factory.informer(NODES),
                    CapacityOptions(namespace=namespace, interval=3600),
                )
                publishing = asyncio.create_task(slow.run())
                try:
                    await asyncio.sleep(0.5)
                    later = await h.create_class("wffc-later", volumeBindingMode="WaitForFirstConsumer")
                    await eventually_async("an object for the new class", lambda: mine(later), 10, 0.2)
                finally:
                    publishing.cancel()
            finally:
                await factory.stop()
                await conn.close()
        finally:
            await force_delete_pods(api, namespace)
            for res in (CSI_NODES, NODES):
                with contextlib.suppress(ApiError):
                    await api.delete(res, node)


async def test_clone_copies_the_source_and_a_missing_node_reschedules(
    control_plane: ControlPlane, api: ApiClient, namespace: str
) -> None:
    async with harness(control_plane, api, namespace) as h:
        cls = await h.create_class("clone")
        await h.create_pvc("source", "8Mi", cls)
        source = (await h.bound("source"))["source"]
        src_file = h.root / "pool" / "volumes" / f"{source['spec']['csi']['volumeHandle']}.img"
        with src_file.open("r+b") as f:
            f.seek(3 * MiB)
            f.write(b"kubeloop clone payload")
        await h.create_pvc(
            "copy", "8Mi", cls, data_source={"kind": "PersistentVolumeClaim", "name": "source"}
        )
        copy = (await h.bound("copy"))["copy"]
        with (h.root / "pool" / "volumes" / f"{copy['spec']['csi']['volumeHandle']}.img").open("rb") as out:
            out.seek(3 * MiB)
            assert out.read(22) == b"kubeloop clone payload"
        await h.assert_files_equal_pvs()

        # A selected node that does not exist (deleted after the scheduler chose it): the claim
        # goes back to the scheduler instead of hanging.
        wffc = await h.create_class("gone-node", volumeBindingMode="WaitForFirstConsumer")
        await h.create_pvc("orphan", "8Mi", wffc, annotations={storage.ANN_SELECTED_NODE: "no-such-node"})
        await h.wait_event("orphan", storage.PROVISIONING_FAILED, 'nodes "no-such-node" not found')

        async def unselected() -> list[str]:
            claim = await h.pvc("orphan")
            ann = (claim or {}).get("metadata", {}).get("annotations") or {}
            return [f"still selected: {ann}"] if storage.ANN_SELECTED_NODE in ann else []

        await eventually_async("unselected", unselected, 20, satisfied=no_problems, context=h.log_tail)
        await h.assert_files_equal_pvs()
