"""The attach-detach controller against the real apiserver, in-process with a fake clock (no test
sleeps through kcm's minutes): the Multi-Attach event naming the pod that holds the volume, the
actual state seeded from a node's status.volumesAttached at start, a deleted node's volume kept
for the unmount timeout, and the out-of-service taint detaching at once.

No attacher runs: a VolumeAttachment that must already be attached is created attached (the
state a running cluster would be in), and VAs this controller creates just stay unattached, which
is all these cases need. Nodes, PVs and VAs are cluster-scoped, so every test uses names of its own
and removes them."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest_asyncio

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.clock_testing import FakeClock
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import (
    EVENTS,
    NODES,
    PERSISTENT_VOLUME_CLAIMS,
    PERSISTENT_VOLUMES,
    PODS,
    VOLUME_ATTACHMENTS,
    Obj,
)
from controller_runtime.volumes import ANN_CONTROLLER_MANAGED, unique_volume_name, va_name
from localstack.controlplane import ControlPlane
from services.attach_detach.controller import AttachDetachController, Options
from services.attach_detach.metrics import METRICS
from tests.support.namespaces import default_service_account
from tests.support.waits import consistently_async, eventually_async, no_problems
from tests.support.writes import until_written

DRIVER = "attach.test.kubeloop.dev"  # no CSIDriver object: attach required


async def follow_real_time(clock: FakeClock) -> None:
    """Moves the fake clock along with real time, so the controller's pacer, queue and backoffs
    run as they would; a test's `step` jumps ahead of it (a minute of waiting without the wait)."""
    last = time.monotonic()
    while True:
        await asyncio.sleep(0.005)
        now = time.monotonic()
        clock.step(now - last)
        last = now


async def exists(api: ApiClient, res: object, name: str) -> bool:
    try:
        await api.get(res, name)  # type: ignore[arg-type]
        return True
    except ApiError as exc:
        if exc.not_found:
            return False
        raise


@dataclass
class Cluster:
    """Objects of one test, named with a random suffix, and the controller under test."""

    api: ApiClient
    cp: ControlPlane
    ns: str
    suffix: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    clock: FakeClock = field(default_factory=FakeClock)
    nodes: list[str] = field(default_factory=list)
    pvs: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    ticker: asyncio.Task[None] | None = None
    client: ApiClient | None = None
    recorder: EventRecorder | None = None

    def name(self, short: str) -> str:
        return f"{short}-{self.suffix}"

    def handle(self, short: str) -> str:
        return self.name(f"vol-{short}")

    def unique(self, short: str) -> str:
        return unique_volume_name(DRIVER, self.handle(short))

    async def node(
        self,
        short: str,
        in_use: tuple[str, ...] = (),
        attached: tuple[str, ...] = (),
        taints: tuple[Obj, ...] = (),
    ) -> str:
        name = self.name(short)
        annotations = {ANN_CONTROLLER_MANAGED: "true"}
        await self.api.create(
            NODES, {"metadata": {"name": name, "annotations": annotations}, "spec": {"taints": list(taints)}}
        )
        self.nodes.append(name)

        async def status() -> None:
            node = await self.api.get(NODES, name)
            node["status"] = {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "t"}],
                "volumesInUse": list(in_use),
                "volumesAttached": [{"name": n, "devicePath": ""} for n in attached],
            }
            await self.api.update_status(NODES, node)

        # kcm's node controllers write the Node too: again on a conflict.
        await until_written(f"the status of node {name}", status, lambda err: err.conflict)
        return name

    async def volume(self, short: str) -> str:
        """A bound claim `c-<short>` and its static CSI PV (RWO)."""
        claim = f"c-{short}"
        pv_name = self.name(f"pv-{short}")
        pvc = await self.api.create(
            PERSISTENT_VOLUME_CLAIMS,
            {
                "metadata": {"name": claim, "namespace": self.ns},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "storageClassName": "",
                    "volumeName": pv_name,
                },
            },
        )
        await self.api.create(
            PERSISTENT_VOLUMES,
            {
                "metadata": {"name": pv_name},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadWriteOnce"],
                    "storageClassName": "",
                    "persistentVolumeReclaimPolicy": "Retain",
                    "claimRef": {"namespace": self.ns, "name": claim, "uid": pvc["metadata"]["uid"]},
                    "csi": {"driver": DRIVER, "volumeHandle": self.handle(short)},
                },
            },
        )
        self.pvs.append(pv_name)
        pvc["status"] = {"phase": "Bound", "accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}}
        await self.api.update_status(PERSISTENT_VOLUME_CLAIMS, pvc)
        return pv_name

    async def pod(self, name: str, node: str, volume_short: str) -> None:
        body = {
            "metadata": {"name": name, "namespace": self.ns},
            "spec": {
                "nodeName": node,
                # kcm's taint eviction must not delete it from the out-of-service node.
                "tolerations": [{"operator": "Exists"}],
                "containers": [{"name": "c", "image": "registry.invalid/none"}],
                "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": f"c-{volume_short}"}}],
            },
        }
        await default_service_account(self.api, self.ns)
        await self.api.create(PODS, body)

    async def delete_pod(self, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        await self.api.request("DELETE", PODS.path(self.ns, name), body=body)

    async def attached_va(self, volume_short: str, node: str) -> str:
        """A VolumeAttachment as a running attacher would have left it: attached."""
        name = va_name(self.handle(volume_short), DRIVER, node)
        pv_name = self.name(f"pv-{volume_short}")
        spec = {"attacher": DRIVER, "nodeName": node, "source": {"persistentVolumeName": pv_name}}
        await self.api.create(VOLUME_ATTACHMENTS, {"metadata": {"name": name}, "spec": spec})
        await self.api.patch(VOLUME_ATTACHMENTS, name, {"status": {"attached": True}}, subresource="status")
        return name

    def va(self, volume_short: str, node: str) -> str:
        return va_name(self.handle(volume_short), DRIVER, node)

    async def node_attached(self, node: str) -> list[str]:
        obj = await self.api.get(NODES, node)
        return sorted(v["name"] for v in (obj.get("status") or {}).get("volumesAttached") or [])

    async def events(self, pod: str) -> list[tuple[str, str]]:
        items, _ = await self.api.list_all(EVENTS, self.ns)
        return [(e["reason"], e["message"]) for e in items if e["involvedObject"]["name"] == pod]

    async def start(self) -> None:
        self.client = await ApiClient.from_kubeconfig(str(self.cp.admin_kubeconfig), qps=0, burst=1)
        self.recorder = EventRecorder(self.client, "attachdetach-controller")
        factory = SharedInformerFactory(self.client)
        context = ControllerContext(self.client, factory, self.recorder, self.clock)
        controller = AttachDetachController(context, Options(loop_period=0.05))
        self.ticker = asyncio.create_task(follow_real_time(self.clock))
        self.task = asyncio.create_task(controller.run())
        await eventually_async("the controller's first pass", self._synced(controller), 30)

    @staticmethod
    def _synced(controller: AttachDetachController) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return controller.synced

        return check

    async def stop(self) -> None:
        for task in (self.task, self.ticker):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.recorder is not None:
            await self.recorder.close()
        if self.client is not None:
            await self.client.close()
        items, _ = await self.api.list_all(VOLUME_ATTACHMENTS)
        for va in items:
            if va["spec"]["nodeName"] in self.nodes:
                with contextlib.suppress(ApiError):
                    await self.api.delete(VOLUME_ATTACHMENTS, va["metadata"]["name"])
        for name in self.nodes:
            with contextlib.suppress(ApiError):
                await self.api.delete(NODES, name)
        for name in self.pvs:
            with contextlib.suppress(ApiError):
                await self.api.delete(PERSISTENT_VOLUMES, name)


@pytest_asyncio.fixture(loop_scope="session")
async def cluster(control_plane: ControlPlane, api: ApiClient, namespace: str) -> AsyncIterator[Cluster]:
    c = Cluster(api, control_plane, namespace)
    try:
        yield c
    finally:
        await c.stop()


async def test_multi_attach_event_names_the_pod_holding_the_volume(cluster: Cluster) -> None:
    c = cluster
    pv = await c.volume("a")
    node_a = await c.node("node-a", in_use=(c.unique("a"),), attached=(c.unique("a"),))
    node_b = await c.node("node-b")
    await c.attached_va("a", node_a)
    await c.pod("holder", node_a, "a")
    await c.pod("waiter", node_b, "a")
    await c.start()

    async def refused() -> bool:
        return bool(await c.events("waiter"))

    await eventually_async("a FailedAttachVolume event on the waiting pod", refused, 20)
    once = [
        (
            "FailedAttachVolume",
            f'Multi-Attach error for volume "{pv}" Volume is already used by pod(s) holder',
        )
    ]

    async def reported_once() -> list[str]:
        events = await c.events("waiter")
        made = await exists(c.api, VOLUME_ATTACHMENTS, c.va("a", node_b))
        return ([f"events {events}"] if events != once else []) + (
            ["a VolumeAttachment on node-b"] if made else []
        )

    # Many passes (loop_period 0.05): none reports again, none attaches.
    await consistently_async("one Multi-Attach event, no attach", reported_once, 0.5, satisfied=no_problems)


async def test_volumes_a_node_lists_are_the_actual_state_at_start(cluster: Cluster) -> None:
    c = cluster
    await c.volume("x")
    await c.volume("y")
    # x: listed, no VA, nobody wants it (detached at once). y: listed, no VA, a pod wants it.
    node = await c.node("node", attached=(c.unique("x"), c.unique("y")))
    await c.pod("user", node, "y")
    await c.start()

    async def x_unlisted() -> bool:
        return await c.node_attached(node) == [c.unique("y")]

    await eventually_async("x to leave the node's volumesAttached", x_unlisted, 20)

    async def y_as_listed() -> list[str]:
        listed = await c.node_attached(node)
        made = await exists(c.api, VOLUME_ATTACHMENTS, c.va("y", node))
        return ([f"volumesAttached {listed}"] if listed != [c.unique("y")] else []) + (
            ["a VA for y"] if made else []
        )

    # y counts as attached, so no VA is made for it.
    await consistently_async("y listed and no VA made for it", y_as_listed, 0.5, satisfied=no_problems)

    c.clock.step(61)  # the periodic check finds y without a VolumeAttachment

    async def y_attaching() -> bool:
        return await exists(c.api, VOLUME_ATTACHMENTS, c.va("y", node))

    await eventually_async("a VolumeAttachment for y", y_attaching, 20)
    await eventually_async("y unlisted until attached", lambda: _equals(c.node_attached(node), []), 20)


async def _equals(value: Awaitable[list[str]], expected: list[str]) -> bool:
    return await value == expected


async def test_deleted_node_keeps_a_mounted_volume_until_the_unmount_timeout(cluster: Cluster) -> None:
    c = cluster
    await c.volume("d")
    node = await c.node("gone", in_use=(c.unique("d"),), attached=(c.unique("d"),))
    va = await c.attached_va("d", node)
    await c.pod("p", node, "d")
    await c.start()
    before = METRICS.forced_detaches.get("timeout", 0)

    await c.delete_pod("p")
    await c.api.delete(NODES, node)

    async def kept() -> bool:
        return await exists(c.api, VOLUME_ATTACHMENTS, va)

    await consistently_async("the VA kept: the node last reported it mounted", kept, 1.0)
    c.clock.step(300)
    await consistently_async("the VA kept: 6 minutes have not passed", kept, 0.5)
    c.clock.step(61)

    async def detached() -> bool:
        return not await exists(c.api, VOLUME_ATTACHMENTS, va)

    await eventually_async("the forced detach after the unmount timeout", detached, 20)
    assert METRICS.forced_detaches.get("timeout", 0) == before + 1


async def test_out_of_service_taint_detaches_a_mounted_volume_at_once(cluster: Cluster) -> None:
    c = cluster
    await c.volume("o")
    taint = {"key": "node.kubernetes.io/out-of-service", "value": "nodeshutdown", "effect": "NoExecute"}
    node = await c.node("down", in_use=(c.unique("o"),), attached=(c.unique("o"),), taints=(taint,))
    va = await c.attached_va("o", node)
    await c.pod("p", node, "o")
    await c.start()

    async def kept() -> bool:
        return await exists(c.api, VOLUME_ATTACHMENTS, va)

    await consistently_async("the VA kept while its pod wants it", kept, 0.5)

    await c.delete_pod("p")

    async def detached() -> bool:
        return not await exists(c.api, VOLUME_ATTACHMENTS, va)

    await eventually_async("the out-of-service detach", detached, 20)
    assert await c.node_attached(node) == []


async def test_a_volume_whose_claim_ref_lacks_the_claim_uid_is_not_attached(cluster: Cluster) -> None:
    """kcm attaches a claim's volume only when the PV's claimRef carries the claim's UID (issue 29):
    a PV an admin unbound, or reserved for the claim's name only, is not the claim's volume even
    while the claim still says Bound and names it. kubeloop accepted a claimRef without a UID, or
    none at all, and attached it."""
    c = cluster
    pv = await c.volume("r")
    claim_ref = (await c.api.get(PERSISTENT_VOLUMES, pv))["spec"]["claimRef"]
    by_name = {k: v for k, v in claim_ref.items() if k in ("kind", "apiVersion", "namespace", "name")}
    await c.api.patch(PERSISTENT_VOLUMES, pv, {"spec": {"claimRef": None}})
    await c.api.patch(PERSISTENT_VOLUMES, pv, {"spec": {"claimRef": by_name}})
    node = await c.node("node")
    await c.pod("user", node, "r")
    await c.start()

    async def not_attached() -> bool:
        return not await exists(c.api, VOLUME_ATTACHMENTS, c.va("r", node))

    # Many passes at loop_period 0.05.
    await consistently_async("no VolumeAttachment for a claimRef without the claim's UID", not_attached, 1.0)

    await c.api.patch(PERSISTENT_VOLUMES, pv, {"spec": {"claimRef": {"uid": claim_ref["uid"]}}})

    async def attaching() -> bool:
        return await exists(c.api, VOLUME_ATTACHMENTS, c.va("r", node))

    await eventually_async("a VolumeAttachment once the claimRef names the claim's UID", attaching, 20)


async def test_a_volume_whose_pv_is_deleted_while_attached_is_still_detached(cluster: Cluster) -> None:
    """Nothing holds the PV of a driver that publishes nothing (the attacher's trivial handler puts
    no finalizer on it), so a claim deleted with its pod may take the PV before the detach. kcm's
    actual state keeps the volume it saw attached and deletes the VA once no pod wants it; so does
    this controller. (Found by tests/kind/test_upstream_manifests.py: the VAs stayed for good.)"""
    c = cluster
    pv = await c.volume("g")
    node = await c.node("gone-pv", attached=(c.unique("g"),))
    va = await c.attached_va("g", node)
    await c.pod("p", node, "g")
    await c.start()

    async def kept() -> bool:
        return await exists(c.api, VOLUME_ATTACHMENTS, va)

    await consistently_async("the VA kept while its pod wants it", kept, 0.5)
    await c.api.delete(PERSISTENT_VOLUMES, pv)
    await eventually_async("the PV gone", lambda: _not(exists(c.api, PERSISTENT_VOLUMES, pv)), 20)
    await c.delete_pod("p")

    async def detached() -> bool:
        return not await exists(c.api, VOLUME_ATTACHMENTS, va)

    await eventually_async("the detach of the volume whose PV is gone", detached, 20)


async def _not(value: Awaitable[bool]) -> bool:
    return not await value
