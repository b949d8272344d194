"""`kubeloop-external-resizer --node-deployment` against the real apiserver and two real node-local
drivers (`--mode all --node-local`, one pool each, as two machines): each node's resizer expands only
the volumes whose node affinity its own Node's labels satisfy, and says nothing about the others.
The claims are made Bound by the test, as the pv-controller would (kcm's binder is off in the test
control plane)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import EVENTS, NODES, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, Obj
from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from external_resizer.controller import Options, Resizer
from kubeloop_grpc.csi import csi_pb2
from localstack.controlplane import ControlPlane
from tests.csi.conftest import Driver
from tests.support import in_process
from tests.support.waits import consistently_async, eventually_async, no_problems

from .resizer_setup import Recording, rwo_volume

pytestmark = pytest.mark.integration

Mode = csi_pb2.VolumeCapability.AccessMode.Mode
MiB = 1 << 20


class Nodes:
    """Two machines: a Node object, a node-local driver and a node-deployment resizer each."""

    def __init__(self, cp: ControlPlane, api: ApiClient, namespace: str) -> None:
        self.cp, self.api, self.ns = cp, api, namespace
        self.suffix = uuid.uuid4().hex[:6]
        self.root = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: socket paths
        self.drivers: dict[str, Driver] = {}
        self.nodes: list[str] = []
        self.pvs: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.closers: list[Callable[[], Awaitable[None]]] = []

    def node(self, short: str) -> str:
        return f"{short}-{self.suffix}"

    async def create_node(self, name: str, labelled: bool) -> None:
        labels = {TOPOLOGY_KEY: name} if labelled else {}
        await self.api.create(NODES, {"metadata": {"name": name, "labels": labels}})
        self.nodes.append(name)

    def start_driver(self, name: str) -> Driver:
        d = Driver(self.root / name[:6], "all", name, ["--node-local"])
        d.root.mkdir()
        d.pool.mkdir()
        self.drivers[name] = d.start()
        return d

    async def start_resizer(self, name: str) -> Recording:
        csi = await Recording.connect(self.drivers[name].endpoint, timeout=10)
        assert isinstance(csi, Recording)
        client = await ApiClient.from_kubeconfig(str(self.cp.admin_kubeconfig), qps=0, burst=1)
        recorder = EventRecorder(client, f"external-resizer {name}")
        factory = SharedInformerFactory(client)
        self.closers += [csi.close, recorder.close, factory.stop, client.close]
        # --handle-volume-inuse-error on (its default): the pods informer is this node's only.
        options = Options(retry_start=0.2, retry_max=1.0, node_name=name)
        resizer = Resizer(ControllerContext(client, factory, recorder), csi, options)
        self.tasks.append(asyncio.create_task(resizer.run()))

        async def synced() -> bool:
            return resizer.synced

        await eventually_async(f"the resizer of {name} synced", synced, 30)
        return csi

    async def volume(self, csi: Recording, name: str) -> str:
        """A 16 MiB volume in that node's pool, as the provisioner creates one for RWO."""
        return await rwo_volume(csi, f"{name}-{self.suffix}")

    async def bound_claim(self, name: str, handle: str, node: str) -> str:
        """A claim asking for 32Mi, Bound to a new 16Mi PV of the driver pinned to `node` as the
        provisioner pins a node-local volume; returns the PV's name."""
        pv_name = f"{name}-{self.suffix}"
        claim = await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": name},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "32Mi"}},
                    "storageClassName": "",
                    "volumeName": pv_name,
                },
            },
            self.ns,
        )
        affinity = {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [node]}]}
        await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": pv_name},
                "spec": {
                    "capacity": {"storage": "16Mi"},
                    "accessModes": ["ReadWriteOnce"],
                    "persistentVolumeReclaimPolicy": "Retain",
                    "storageClassName": "",
                    "claimRef": {"namespace": self.ns, "name": name, "uid": claim["metadata"]["uid"]},
                    "csi": {"driver": DRIVER_NAME, "volumeHandle": handle, "fsType": "ext4"},
                    "nodeAffinity": {"required": {"nodeSelectorTerms": [affinity]}},
                },
            },
        )
        self.pvs.append(pv_name)
        claim["status"] = {
            "phase": "Bound",
            "accessModes": ["ReadWriteOnce"],
            "capacity": {"storage": "16Mi"},
        }
        await self.api.update_status(PERSISTENT_VOLUME_CLAIMS, claim)
        return pv_name

    async def events(self, claim: str) -> list[Obj]:
        items = (await self.api.list_page(EVENTS, self.ns))["items"]
        return [e for e in items if e["involvedObject"].get("name") == claim]

    async def close(self) -> None:
        await in_process.stop(self.tasks, self.closers)
        for name in self.pvs:
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUMES, name)
        for name in self.nodes:
            with contextlib.suppress(ApiError):
                await self.api.delete(NODES, name)
        for d in self.drivers.values():
            d.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="session")
async def machines(control_plane: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[Nodes]:
    m = Nodes(control_plane, api, namespace)
    try:
        yield m
    finally:
        await m.close()


async def test_only_the_volumes_node_expands_it(machines: Nodes) -> None:
    """A claim whose PV is pinned to node-b is expanded by node-b's resizer alone. node-b's Node
    has no topology label yet when its resizer starts (kubelet adds it once the plugin registers):
    nothing is expanded until the label comes, and then the claim is looked at again at once.
    node-a's resizer, whose driver has no such volume, never calls it nor writes an event."""
    m, api = machines, machines.api
    node_a, node_b = m.node("node-a"), m.node("node-b")
    await m.create_node(node_a, labelled=True)
    await m.create_node(node_b, labelled=False)
    m.start_driver(node_a)
    m.start_driver(node_b)
    csi_a = await m.start_resizer(node_a)
    csi_b = await m.start_resizer(node_b)
    handle = await m.volume(csi_b, "grow")
    pv = await m.bound_claim("grow", handle, node_b)

    async def not_grown() -> list[str]:
        capacity = (await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"]
        events = await m.events("grow")
        problems = (
            [f"ControllerExpandVolume {csi_a.expands} {csi_b.expands}"]
            if csi_a.expands or csi_b.expands
            else []
        )
        problems += [f"capacity {capacity}"] if capacity != {"storage": "16Mi"} else []
        return problems + ([f"events {events}"] if events else [])

    # Several syncs' worth: node-b's labels do not satisfy the PV yet.
    await consistently_async("the volume not grown by either node", not_grown, 2, 0.2, satisfied=no_problems)

    await api.patch(NODES, node_b, {"metadata": {"labels": {TOPOLOGY_KEY: node_b}}})

    async def grown() -> bool:
        return bool((await api.get(PERSISTENT_VOLUMES, pv))["spec"]["capacity"] == {"storage": "32Mi"})

    await eventually_async("the PV grown to 32Mi by node-b's resizer", grown, 30)
    assert [r.volume_id for r in csi_b.expands] == [handle]
    assert csi_a.expands == []
    events = await m.events("grow")
    assert {e["source"]["component"] for e in events} == {f"external-resizer {node_b}"}
    assert "VolumeResizeFailed" not in {e["reason"] for e in events}
