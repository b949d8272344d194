"""The attach-detach controller's bookkeeping around `decide`, with its informer caches filled by
hand, an in-memory client that records writes, and a fake clock: the actual state seeded from the
nodes' status at start, the periodic check of those seeded entries, assumed mounts, deleted nodes,
the desired-state populator, the attach timeout, and Multi-Attach events once per node and
volume, and the attach outcome reported to the pods that wanted the attach when it started."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, cast

from controller_runtime.client import ApiClient
from controller_runtime.clock_testing import FakeClock
from controller_runtime.controller import ControllerContext
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import Obj, Resource
from controller_runtime.volumes import ANN_CONTROLLER_MANAGED, unique_volume_name, va_name
from services.attach_detach.controller import AttachDetachController, Options
from services.attach_detach.decide import (
    ATTACH_FAILED_MESSAGE,
    ATTACH_SUCCEEDED_MESSAGE,
    DesiredVolume,
    PodRef,
)
from services.attach_detach.desired_state import DesiredState

DRIVER = "loop.csi.kubeloop.dev"


@dataclass
class Writes:
    """The client: records every write, answers like an apiserver that accepted it."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)

    async def create(self, res: Resource, body: Obj, **_: Any) -> Obj:
        self.calls.append(("create", res.plural, body["metadata"]["name"]))
        return body

    async def delete(self, res: Resource, name: str, **_: Any) -> None:
        self.calls.append(("delete", res.plural, name))

    async def patch(self, res: Resource, name: str, body: Obj, **_: Any) -> Obj:
        self.calls.append(("patch", res.plural, name))
        return body


@dataclass
class Events:
    items: list[tuple[str, str, str]] = field(default_factory=list)

    def normal(self, obj: Obj, reason: str, message: str) -> None:
        self.items.append((obj["metadata"]["name"], reason, message))

    def warning(self, obj: Obj, reason: str, message: str) -> None:
        self.items.append((obj["metadata"]["name"], reason, message))


def unique(handle: str) -> str:
    return unique_volume_name(DRIVER, handle)


def node(name: str, in_use: tuple[str, ...] = (), attached: tuple[str, ...] = (), **spec: Any) -> Obj:
    return {
        "metadata": {"name": name, "annotations": {ANN_CONTROLLER_MANAGED: "true"}},
        "spec": spec,
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "volumesInUse": list(in_use),
            "volumesAttached": [{"name": n, "devicePath": ""} for n in attached],
        },
    }


def pv(handle: str, modes: tuple[str, ...] = ("ReadWriteOnce",)) -> Obj:
    return {
        "metadata": {"name": f"pv-{handle}"},
        "spec": {
            "accessModes": list(modes),
            "csi": {"driver": DRIVER, "volumeHandle": handle},
            "claimRef": {"namespace": "ns", "name": f"c-{handle}", "uid": f"cu-{handle}"},
        },
    }


def pvc(handle: str) -> Obj:
    return {
        "metadata": {"namespace": "ns", "name": f"c-{handle}", "uid": f"cu-{handle}"},
        "spec": {"volumeName": f"pv-{handle}"},
        "status": {"phase": "Bound"},
    }


def pod(name: str, node_name: str, handle: str, uid: str = "") -> Obj:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": uid or f"u-{name}"},
        "spec": {
            "nodeName": node_name,
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": f"c-{handle}"}}],
        },
        "status": {"phase": "Running"},
    }


def va(handle: str, node_name: str, attached: bool = True, error: str = "") -> Obj:
    status: Obj = {"attached": attached}
    if error:
        status["attachError"] = {"message": error}
    return {
        "metadata": {"name": va_name(handle, DRIVER, node_name)},
        "spec": {
            "attacher": DRIVER,
            "nodeName": node_name,
            "source": {"persistentVolumeName": f"pv-{handle}"},
        },
        "status": status,
    }


class World:
    def __init__(self) -> None:
        self.clock = FakeClock()
        self.writes = Writes()
        self.events = Events()
        client = cast(ApiClient, self.writes)
        context = ControllerContext(
            client, SharedInformerFactory(client), cast(EventRecorder, self.events), self.clock
        )
        self.c = AttachDetachController(context, Options())

    @classmethod
    def mounted_on_node_a(cls) -> World:
        """Volume v attached to node-a (VA and node status) and mounted there."""
        w = cls()
        w.add_volume("v")
        w.add_node(node("node-a", in_use=(unique("v"),), attached=(unique("v"),)))
        w.c.vas.store.upsert(va("v", "node-a"))
        return w

    @classmethod
    async def attaching(cls, first_pod: str, *nodes: str) -> World:
        """Volume v on fresh nodes (node-a and `nodes`), wanted by `first_pod` on node-a, whose
        attach has just started."""
        w = cls()
        w.add_volume("v")
        for name in ("node-a", *nodes):
            w.add_node(node(name))
        w.c.seed_actual_state()
        await w.add_pod(pod(first_pod, "node-a", "v"))
        await w.reconcile()
        assert w.written("create", "volumeattachments") == [va_name("v", DRIVER, "node-a")]
        return w

    def add_volume(self, handle: str, modes: tuple[str, ...] = ("ReadWriteOnce",)) -> None:
        self.c.pvs.store.upsert(pv(handle, modes))
        self.c.pvcs.store.upsert(pvc(handle))

    def add_node(self, obj: Obj) -> None:
        self.c.nodes.store.upsert(obj)
        self.c._node_added(obj)

    def update_node(self, obj: Obj) -> None:
        old = self.c.nodes.store.upsert(obj)
        self.c._node_updated(old or obj, obj)

    async def add_pod(self, obj: Obj) -> None:
        self.c.pods.store.upsert(obj)
        md = obj["metadata"]
        await self.c.sync_pod(f"{md['namespace']}/{md['name']}")

    async def delete_pod(self, name: str) -> None:
        self.c.pods.store.delete(f"ns/{name}")
        await self.c.sync_pod(f"ns/{name}")

    async def reconcile(self) -> None:
        self.writes.calls.clear()
        await self.c.reconcile()
        for _ in range(5):  # let the started operations run
            await asyncio.sleep(0)

    def written(self, verb: str, plural: str) -> list[str]:
        return [name for v, p, name in self.writes.calls if (v, p) == (verb, plural)]


def test_node_status_is_the_actual_state_at_start() -> None:
    async def main() -> None:
        w = World()
        for h in ("x", "y", "z"):
            w.add_volume(h)
        # x: listed, no VA, nobody wants it. y: listed, no VA, a pod wants it. z: a VA nobody lists.
        w.add_node(node("node-a", attached=(unique("x"), unique("y"))))
        w.c.vas.store.upsert(va("z", "node-a"))
        await w.add_pod(pod("p", "node-a", "y"))
        w.c.seed_actual_state()
        atts = {a.handle: a for a in w.c.attachments(w.clock.monotonic())}
        assert atts["x"].attached and atts["y"].attached and not atts["x"].pv_name

        await w.reconcile()
        assert w.written("delete", "volumeattachments") == [va_name("x", DRIVER, "node-a")], (
            "x is detached (its VA is gone already: the delete's NotFound is success)"
        )
        assert w.written("create", "volumeattachments") == [], "y counts as attached: no VA yet"
        assert w.c.node_infos()["node-a"].in_use == {unique("z")}, "z is new: assumed mounted"
        assert va_name("z", DRIVER, "node-a") not in w.written("delete", "volumeattachments")

        # The node reports again: the assumption ends, z (unwanted, unmounted) is detached.
        w.update_node(node("node-a", attached=(unique("y"),)))
        await w.reconcile()
        assert w.written("delete", "volumeattachments") == [va_name("z", DRIVER, "node-a")]

        # kcm's periodic check: y has no VolumeAttachment after all, so it is attached anew.
        w.clock.step(61)
        await w.reconcile()
        assert w.written("create", "volumeattachments") == [va_name("y", DRIVER, "node-a")]

    asyncio.run(main())


def test_deleted_node_keeps_its_mounts_and_its_pods_volumes() -> None:
    async def main() -> None:
        w = World.mounted_on_node_a()
        await w.add_pod(pod("p", "node-a", "v"))
        w.c.seed_actual_state()
        await w.reconcile()

        gone = w.c.nodes.store.delete("node-a")
        assert gone is not None
        w.c._node_deleted(gone)
        await w.c.sync_pod("ns/p")
        assert w.c.desired.entries(), "the pod still wants its volume on the deleted node"
        await w.reconcile()
        assert not w.written("delete", "volumeattachments")

        await w.delete_pod("p")
        await w.reconcile()
        assert not w.written("delete", "volumeattachments"), "still mounted as last reported"
        w.clock.step(361)
        await w.reconcile()
        assert w.written("delete", "volumeattachments") == [va_name("v", DRIVER, "node-a")]
        assert w.written("patch", "nodes") == [], "a deleted node's status is not written"

    asyncio.run(main())


def test_populator_drops_vanished_pods_and_requeues_all_every_three_minutes() -> None:
    async def main() -> None:
        w = World()
        w.add_volume("v")
        w.add_node(node("node-a"))
        await w.add_pod(pod("p", "node-a", "v"))
        await w.add_pod(pod("q", "node-a", "v"))
        # Events lost: p is gone, q was replaced by a new pod of the same name.
        w.c.pods.store.delete("ns/p")
        w.c.pods.store.upsert(pod("q", "node-a", "v", uid="new-uid"))
        w.c.populate(w.clock.monotonic() + 60)
        assert not w.c.desired.pods
        assert len(w.c.pod_queue) == 0, "re-adding waits for the three-minute list"
        w.c.populate(w.clock.monotonic() + 180)
        assert len(w.c.pod_queue) == 1

        # A driver that stops needing attachment: its volumes leave the desired state.
        await w.c.sync_pod("ns/q")
        assert w.c.desired.entries()
        w.c.drivers.store.upsert({"metadata": {"name": DRIVER}, "spec": {"attachRequired": False}})
        w.c.populate(w.clock.monotonic() + 240)
        assert not w.c.desired.entries()

    asyncio.run(main())


def test_attach_waits_for_its_timeout_then_is_uncertain() -> None:
    async def main() -> None:
        w = await World.attaching("p", "node-b")
        w.c.vas.store.upsert(va("v", "node-a", attached=False))
        await w.add_pod(pod("q", "node-b", "v"))
        await w.reconcile()
        assert not w.written("create", "volumeattachments") and not w.events.items, (
            "node-b waits silently for node-a's attach"
        )
        w.clock.step(121)
        await w.reconcile()
        assert (
            "p",
            "FailedAttachVolume",
            (
                'AttachVolume.Attach failed for volume "pv-v" : timed out waiting for external-attacher of '
                f"{DRIVER} CSI driver to attach volume v"
            ),
        ) in w.events.items
        assert w.written("create", "volumeattachments") == [va_name("v", DRIVER, "node-b")], (
            "an uncertain attachment does not hold the volume"
        )

    asyncio.run(main())


def test_multi_attach_event_once_per_node_and_volume() -> None:
    async def main() -> None:
        w = World.mounted_on_node_a()
        w.add_node(node("node-b"))
        w.c.seed_actual_state()
        await w.add_pod(pod("web-0", "node-a", "v"))
        await w.add_pod(pod("web-1", "node-b", "v"))
        await w.reconcile()
        await w.add_pod(pod("web-2", "node-b", "v"))
        await w.reconcile()
        message = 'Multi-Attach error for volume "pv-v" Volume is already used by pod(s) web-0'
        assert w.events.items == [("web-1", "FailedAttachVolume", message)], (
            "web-2 joined a volume and node already reported"
        )

    asyncio.run(main())


def test_attachment_no_node_listed_at_start_is_reported_once_attached() -> None:
    async def main() -> None:
        w = World()
        w.add_volume("v")
        w.add_volume("w")
        w.add_node(node("node-a", in_use=(unique("w"),), attached=(unique("w"),)))
        w.c.vas.store.upsert(va("v", "node-a"))  # attached, but the node status never said so
        w.c.vas.store.upsert(va("w", "node-a"))  # attached and listed: nothing to report
        await w.add_pod(pod("p", "node-a", "v"))
        await w.add_pod(pod("q", "node-a", "w"))
        w.c.seed_actual_state()
        await w.reconcile()
        assert w.events.items == [
            ("p", "SuccessfulAttachVolume", 'AttachVolume.Attach succeeded for volume "pv-v" ')
        ]
        assert w.written("patch", "nodes") == ["node-a"]

    asyncio.run(main())


def test_attach_messages_are_kcms_byte_for_byte() -> None:
    """kcm formats "<prefix> for volume <name> <suffix>": an empty suffix leaves a trailing space,
    an error suffix starts with ": " after that space."""
    assert ATTACH_SUCCEEDED_MESSAGE.format(pv="pv1") == 'AttachVolume.Attach succeeded for volume "pv1" '
    failed = ATTACH_FAILED_MESSAGE.format(pv="pv1", error="x")
    assert failed == 'AttachVolume.Attach failed for volume "pv1" : x'


def test_attach_success_goes_to_the_pods_present_when_the_attach_started() -> None:
    async def main() -> None:
        w = await World.attaching("p1")
        # A second pod on the same node joins the attach while it is under way.
        w.c.vas.store.upsert(va("v", "node-a", attached=False))
        await w.add_pod(pod("p2", "node-a", "v"))
        await w.reconcile()
        w.c.vas.store.upsert(va("v", "node-a", attached=True))
        await w.reconcile()
        # kcm's message ends in a space: its suffix (empty here) follows one.
        assert w.events.items == [
            ("p1", "SuccessfulAttachVolume", 'AttachVolume.Attach succeeded for volume "pv-v" ')
        ]

    asyncio.run(main())


def test_attach_failure_goes_to_the_attachs_pods_and_its_retry_to_those_of_then() -> None:
    async def main() -> None:
        w = await World.attaching("p1")
        await w.add_pod(pod("p2", "node-a", "v"))
        w.c.vas.store.upsert(va("v", "node-a", attached=False, error="boom"))
        await w.reconcile()
        failed = 'AttachVolume.Attach failed for volume "pv-v" : boom'
        assert w.events.items == [("p1", "FailedAttachVolume", failed)]
        w.events.items.clear()
        w.c.vas.store.upsert(va("v", "node-a", attached=True))
        await w.reconcile()
        succeeded = 'AttachVolume.Attach succeeded for volume "pv-v" '
        assert sorted(w.events.items) == [
            ("p1", "SuccessfulAttachVolume", succeeded),
            ("p2", "SuccessfulAttachVolume", succeeded),
        ]

    asyncio.run(main())


def test_an_attachment_is_read_again_only_when_its_va_or_pv_changed() -> None:
    """Every pass builds the actual state from every VA; a VA and PV whose resourceVersions have
    not moved give the very same Attachment, a newer VA (or PV) a new one."""
    w = World()
    w.add_volume("v")
    pv = w.c.pvs.store.get("pv-v")
    assert pv is not None
    w.c.pvs.store.upsert({**pv, "metadata": {**pv["metadata"], "resourceVersion": "3"}})
    first = {
        **va("v", "node-a", attached=False),
        "metadata": {"name": va_name("v", DRIVER, "node-a"), "resourceVersion": "7"},
    }
    w.c.vas.store.upsert(first)
    (a,) = w.c.attachments(w.clock.monotonic())
    (b,) = w.c.attachments(w.clock.monotonic())
    assert a is b and not a.attached
    w.c.vas.store.upsert(
        {**first, "metadata": {**first["metadata"], "resourceVersion": "8"}, "status": {"attached": True}}
    )
    (c,) = w.c.attachments(w.clock.monotonic())
    assert c.attached and c.unique_name == unique("v")
    w.c.vas.store.delete(first["metadata"]["name"])
    assert w.c.attachments(w.clock.monotonic()) == [] and w.c._attachment_cache == {}


def test_desired_entries_are_grouped_again_only_after_a_change() -> None:
    state = DesiredState()
    vol = DesiredVolume("pv-v", DRIVER, "v", unique("v"), multi_node=False)
    state.set_pod(PodRef("ns", "p", "u1"), "node-a", [vol])
    first = state.entries()
    assert state.entries() == first and state._entries is not None
    state.set_pod(PodRef("ns", "p", "u1"), "node-a", [vol])  # the same contribution: no change
    assert state._entries is not None
    state.set_pod(PodRef("ns", "q", "u2"), "node-a", [vol])
    assert [e.pods for e in state.entries()] == [(PodRef("ns", "p", "u1"), PodRef("ns", "q", "u2"))]
    state.remove_pod("ns/p")
    assert [e.pods for e in state.entries()] == [(PodRef("ns", "q", "u2"),)]


def test_a_pass_is_woken_only_by_what_it_decides_on() -> None:
    async def main() -> None:
        w = World()
        w.add_volume("v")
        w.add_node(node("node-a"))
        wake = w.c._wake

        def woken() -> bool:
            was = wake.is_set()
            wake.clear()
            return was

        woken()
        started = pod("p", "node-a", "v")
        await w.add_pod(started)
        assert woken(), "a pod that wants a volume"
        await w.add_pod({**started, "status": {"phase": "Running", "podIP": "10.0.0.7"}})
        assert not woken(), "its status changed, not what it wants"

        created = va("v", "node-a", attached=False)
        finalized = {**created, "metadata": {**created["metadata"], "finalizers": ["external-attacher"]}}
        w.c._va_updated(created, finalized)
        assert not woken(), "the attacher's finalizer"
        w.c._va_updated(finalized, va("v", "node-a", attached=True))
        assert woken(), "attached"

        w.update_node(node("node-a", attached=(unique("v"),)))
        assert not woken(), "this controller's own volumesAttached write"
        w.update_node(node("node-a", in_use=(unique("v"),), attached=(unique("v"),)))
        assert not woken(), "a volume the node started using"
        w.update_node(node("node-a", attached=(unique("v"),)))
        assert woken(), "a volume the node stopped using"
        not_ready = node("node-a", attached=(unique("v"),))
        not_ready["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        w.update_node(not_ready)
        assert woken(), "readiness"

        await w.delete_pod("p")
        assert woken(), "the pod went away"

    asyncio.run(main())
