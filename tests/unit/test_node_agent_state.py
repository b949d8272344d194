"""The node agent's volume manager in kubelet's parts, in memory: the actual and the desired state
of the world, the populator that fills the desired state from the caches, and the reconciler's
decisions (which operations a pass starts, from the node's status)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable
from pathlib import Path
from typing import Any, cast

import pytest

from controller_runtime.client import ApiClient
from controller_runtime.clock_testing import FakeClock
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.operations import Backoff, OperationExecutor
from controller_runtime.resources import NODES, PERSISTENT_VOLUME_CLAIMS, PERSISTENT_VOLUMES, PODS, Obj
from controller_runtime.store import Store
from controller_runtime.volumes import CSIVolume, unique_volume_name
from services.node_agent.actual_state import ActualStateOfWorld, DeviceMountState, VolumeMountState
from services.node_agent.decide import Mounted, PodVolume, ready_to_mount
from services.node_agent.desired_state import DesiredStateOfWorld
from services.node_agent.disk import Layout
from services.node_agent.populator import DesiredStateOfWorldPopulator
from services.node_agent.reconciler import EXPAND, MOUNT, UNPUBLISH, UNSTAGE
from services.node_agent.volume_manager import VolumeManager, pods_on_node

DRIVER = "loop.csi.kubeloop.dev"
NODE = "node-a"


def csi(handle: str, *, ephemeral: bool = False) -> CSIVolume:
    name = handle if ephemeral else f"pv-{handle}"
    return CSIVolume(name, DRIVER, handle, ("ReadWriteOnce",), False, "ext4", False, (), {}, ephemeral)


def want(uid: str, handle: str, pod: str = "") -> PodVolume:
    return PodVolume(uid, f"ns/{pod or uid}", csi(handle), False)


def published(uid: str, handle: str) -> Mounted:
    return Mounted(uid, f"pv-{handle}", DRIVER, handle, False)


# -- the actual state -----------------------------------------------------------------------------


def test_a_publish_is_uncertain_until_mounted_and_gone_once_unmounted() -> None:
    asw = ActualStateOfWorld()
    assert asw.get_volume_mount_state("u1", "pv-v1") is VolumeMountState.NOT_MOUNTED
    asw.mark_volume_mount_as_uncertain(published("u1", "v1"))
    assert asw.get_volume_mount_state("u1", "pv-v1") is VolumeMountState.UNCERTAIN
    assert not asw.pod_exists_in_volume("u1", "pv-v1"), "an uncertain publish is not mounted"
    assert asw.get_all_mounted_volumes() == {("u1", "pv-v1"): published("u1", "v1")}
    assert asw.get_mounted_volumes() == () and asw.get_mounted_volume_keys() == frozenset()
    assert asw.get_possibly_mounted_volumes_for_pod("u1") == (published("u1", "v1"),)
    assert asw.volume_published_for_any_pod((DRIVER, "v1"))

    asw.mark_volume_as_mounted("u1", "pv-v1")
    assert asw.get_volume_mount_state("u1", "pv-v1") is VolumeMountState.MOUNTED
    assert asw.pod_exists_in_volume("u1", "pv-v1")
    assert asw.get_mounted_volumes() == (published("u1", "v1"),)
    assert asw.get_mounted_volume_keys() == {("u1", "pv-v1")}

    asw.mark_volume_as_unmounted("u1", "pv-v1")
    assert asw.get_volume_mount_state("u1", "pv-v1") is VolumeMountState.NOT_MOUNTED
    assert asw.get_all_mounted_volumes() == {} and asw.get_possibly_mounted_volumes_for_pod("u1") == ()
    assert not asw.volume_published_for_any_pod((DRIVER, "v1"))


def test_a_publish_never_begun_cannot_be_mounted() -> None:
    with pytest.raises(KeyError):
        ActualStateOfWorld().mark_volume_as_mounted("u1", "pv-v1")


def test_what_the_actual_state_hands_out_is_a_copy() -> None:
    asw = ActualStateOfWorld()
    asw.mark_volume_mount_as_uncertain(published("u1", "v1"))
    asw.mark_device_as_mounted((DRIVER, "v1"))
    copy = asw.get_all_mounted_volumes()
    copy.clear()
    assert asw.get_all_mounted_volumes(), "clearing the copy changes nothing"
    assert isinstance(asw.get_possibly_mounted_devices(), frozenset)
    assert isinstance(asw.get_mounted_volume_keys(), frozenset)
    assert all(name.startswith("_") for name in vars(asw)), "no public mutable state"
    assert all(name.startswith("_") for name in vars(DesiredStateOfWorld()))


def test_a_staging_is_uncertain_from_its_stage_or_its_unstage_until_the_call_returns() -> None:
    asw = ActualStateOfWorld()
    key = (DRIVER, "v1")
    assert asw.get_device_mount_state(key) is DeviceMountState.NOT_MOUNTED
    asw.mark_device_as_uncertain(key)  # vol_data.json written, NodeStageVolume under way
    assert asw.get_device_mount_state(key) is DeviceMountState.UNCERTAIN
    assert asw.get_possibly_mounted_devices() == {key}
    asw.mark_device_as_mounted(key)
    assert asw.get_device_mount_state(key) is DeviceMountState.GLOBALLY_MOUNTED
    asw.mark_device_as_uncertain(key)  # NodeUnstageVolume under way: stage again before a publish
    assert asw.get_device_mount_state(key) is DeviceMountState.UNCERTAIN
    asw.mark_device_as_unmounted(key)
    assert asw.get_device_mount_state(key) is DeviceMountState.NOT_MOUNTED
    assert asw.get_possibly_mounted_devices() == frozenset()


def test_an_in_use_expansion_error_is_kept_until_cleared() -> None:
    asw = ActualStateOfWorld()
    key = (DRIVER, "v1")
    assert not asw.has_in_use_expansion_error(key)
    asw.mark_for_in_use_expansion_error(key)
    assert asw.has_in_use_expansion_error(key)
    asw.clear_in_use_expansion_error(key)
    assert not asw.has_in_use_expansion_error(key)


# -- the desired state ----------------------------------------------------------------------------


def test_the_desired_state_keeps_pods_and_their_volumes_in_the_order_added() -> None:
    dsw = DesiredStateOfWorld()
    dsw.add_pod("u2", "ns/b", volumes_resolved=True)
    dsw.add_pod("u1", "ns/a", volumes_resolved=False)
    dsw.add_pod_to_volume(want("u2", "v2", "b"))
    dsw.add_pod_to_volume(want("u1", "v1", "a"))
    dsw.add_pod_to_volume(want("u2", "v3", "b"))
    assert [v.key for v in dsw.get_volumes_to_mount()] == [("u2", "pv-v2"), ("u2", "pv-v3"), ("u1", "pv-v1")]
    assert dsw.get_pods_with_resolved_volumes() == {"ns/b": (want("u2", "v2", "b"), want("u2", "v3", "b"))}
    assert dsw.pod_exists_in_volume("u1", "pv-v1") and not dsw.pod_exists_in_volume("u1", "pv-v2")
    assert dsw.get_pod_uids() == {"u1", "u2"}
    assert dsw.get_volume_names_for_pod("u2") == {"pv-v2", "pv-v3"}

    dsw.add_pod("u2", "ns/b", volumes_resolved=True)  # added again: keeps its place and volumes
    dsw.add_pod("u1", "ns/a", volumes_resolved=True)  # its claim resolved meanwhile
    assert dsw.get_volumes_to_mount()[0].key == ("u2", "pv-v2")
    assert set(dsw.get_pods_with_resolved_volumes()) == {"ns/a", "ns/b"}

    dsw.delete_pod_from_volume("u2", "pv-v2")
    assert dsw.get_volume_names_for_pod("u2") == {"pv-v3"}
    dsw.delete_pod("u2")
    assert [v.key for v in dsw.get_volumes_to_mount()] == [("u1", "pv-v1")]
    assert dsw.get_volume_names_for_pod("u2") == frozenset()
    dsw.delete_pod_from_volume("u2", "pv-v3")  # a pod already gone: nothing to do


def test_a_volume_of_a_pod_never_added_is_refused() -> None:
    with pytest.raises(KeyError):
        DesiredStateOfWorld().add_pod_to_volume(want("u1", "v1"))


# -- the populator --------------------------------------------------------------------------------


def pod(name: str, *claims: str, uid: str = "", **metadata: Any) -> Obj:
    volumes = [{"name": c, "persistentVolumeClaim": {"claimName": c}} for c in claims]
    md = {"name": name, "namespace": "ns", "uid": uid or f"uid-{name}", **metadata}
    return {"metadata": md, "spec": {"nodeName": NODE, "volumes": volumes}, "status": {"phase": "Pending"}}


def claim(name: str, volume: str = "", bound: bool = True) -> Obj:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "spec": {"volumeName": volume or f"pv-{name}"},
        "status": {"phase": "Bound" if bound else "Pending"},
    }


def volume(claim_name: str) -> Obj:
    return {
        "metadata": {"name": f"pv-{claim_name}"},
        "spec": {
            "csi": {"driver": DRIVER, "volumeHandle": claim_name},
            "accessModes": ["ReadWriteOnce"],
            "claimRef": {"namespace": "ns", "name": claim_name, "uid": f"uid-{claim_name}"},
        },
    }


def stores(*objs: Obj) -> Store:
    store = Store()
    for obj in objs:
        store.upsert(obj)
    return store


def test_the_populator_fills_the_desired_state_from_the_caches() -> None:
    pods = stores(
        pod("app", "data"),
        pod("waits", "unbound"),  # its claim is not bound: it wants nothing it can have yet
        pod("leaving", "data", deletionTimestamp="2026-11-28T10:00:00Z"),
        {**pod("done", "data"), "status": {"phase": "Succeeded"}},
    )
    claims = stores(claim("data"), claim("unbound", bound=False))
    dsw = DesiredStateOfWorld()
    populator = DesiredStateOfWorldPopulator(
        dsw, pods=pods, claims=claims, volumes=stores(volume("data")), drivers=Store()
    )
    populator.populate()
    assert [v.key for v in dsw.get_volumes_to_mount()] == [("uid-app", "pv-data")]
    assert dsw.get_pods_with_resolved_volumes() == {"ns/app": tuple(dsw.get_volumes_to_mount())}
    assert dsw.get_pod_uids() == {"uid-app", "uid-waits"}, "a pod being deleted or finished wants nothing"

    # The pod drops its claim, another pod is gone: the next populate follows the caches.
    pods.upsert(pod("app"))
    pods.delete("ns/waits")
    populator.populate()
    assert dsw.get_volumes_to_mount() == ()
    assert dsw.get_pods_with_resolved_volumes() == {"ns/app": ()}
    assert dsw.get_pod_uids() == {"uid-app"}


def test_the_populator_gives_inline_volumes_the_pods_information_when_the_driver_asks() -> None:
    inline = {"name": "scratch", "csi": {"driver": DRIVER, "volumeAttributes": {"size": "1Gi"}}}
    app = pod("app")
    app["spec"]["volumes"] = [inline]
    drivers = stores({"metadata": {"name": DRIVER}, "spec": {"podInfoOnMount": True}})
    dsw = DesiredStateOfWorld()
    DesiredStateOfWorldPopulator(
        dsw, pods=stores(app), claims=Store(), volumes=Store(), drivers=drivers
    ).populate()
    (wanted,) = dsw.get_volumes_to_mount()
    assert wanted.volume.ephemeral
    assert wanted.volume.attributes["size"] == "1Gi"
    assert wanted.volume.attributes["csi.storage.k8s.io/pod.name"] == "app"


# -- the reconciler -------------------------------------------------------------------------------


def test_a_volume_is_mounted_once_in_use_and_attached_an_inline_one_at_once() -> None:
    pv = PodVolume("u1", "ns/a", csi("v1"), False)
    name = unique_volume_name(DRIVER, "v1")
    assert not ready_to_mount(pv, set(), {name}, attach_required=True), "reported in use first"
    assert not ready_to_mount(pv, {name}, set(), attach_required=True), "then attached"
    assert ready_to_mount(pv, {name}, {name}, attach_required=True)
    assert ready_to_mount(pv, {name}, set(), attach_required=False), "no attach for this driver"
    inline = PodVolume("u1", "ns/a", csi("scratch", ephemeral=True), False)
    assert ready_to_mount(inline, set(), set(), attach_required=True)


class _Operations:
    """Records what a pass starts instead of running it."""

    def __init__(self) -> None:
        self.started: list[tuple[Hashable, int]] = []

    def run(self, key: Any, coro: Coroutine[Any, Any, None], *, operation: Hashable, priority: int) -> None:
        coro.close()
        self.started.append((operation, priority))


class _Client:
    def __init__(self) -> None:
        self.patches: list[Obj] = []

    async def patch(self, _res: Any, _name: str, patch: Obj, **_kw: Any) -> Obj:
        self.patches.append(patch)
        return {}


def manager(tmp_path: Path) -> tuple[VolumeManager, SharedInformerFactory, _Client, _Operations]:
    client = _Client()
    factory = SharedInformerFactory(cast(ApiClient, client))
    vm = VolumeManager(
        factory,
        cast(EventRecorder, object()),
        NODE,
        Layout(tmp_path),
        {},
        csi_timeout=1.0,
        backoff=Backoff(0.5, 1.0),
        max_concurrent_operations=0,
        clock=FakeClock(),
    )
    ops = _Operations()
    vm.reconciler.operations = cast(OperationExecutor[tuple[str, str]], ops)
    return vm, factory, client, ops


def node(in_use: tuple[str, ...] = (), attached: tuple[str, ...] = ()) -> Obj:
    status = {"volumesInUse": list(in_use), "volumesAttached": [{"name": n} for n in attached]}
    return {"metadata": {"name": NODE}, "status": status}


def test_the_volume_manager_shares_the_pods_informer_of_its_node(tmp_path: Path) -> None:
    vm, factory, _, _ = manager(tmp_path)
    assert factory.informer(PODS, field_selector=pods_on_node(NODE)) is vm.pods
    assert factory.informer(PODS) is not vm.pods, "every pod is another cache"


def test_a_pass_reports_in_use_then_mounts_once_attached(tmp_path: Path) -> None:
    async def main() -> None:
        vm, factory, client, ops = manager(tmp_path)
        factory.informer(PODS, field_selector=pods_on_node(NODE)).store.upsert(pod("app", "data"))
        factory.informer(PERSISTENT_VOLUME_CLAIMS).store.upsert(claim("data"))
        factory.informer(PERSISTENT_VOLUMES).store.upsert(volume("data"))
        nodes = factory.informer(NODES, field_selector=f"metadata.name={NODE}").store
        nodes.upsert(node())
        name = unique_volume_name(DRIVER, "data")

        complete = await vm.reconcile()
        assert client.patches == [{"status": {"volumesInUse": [name]}}]
        assert ops.started == [], "not mounted before the node reports it in use"
        assert list(complete) == ["ns/app"]

        nodes.upsert(node(in_use=(name,)))
        await vm.reconcile()
        assert ops.started == [], "no CSIDriver: the volume needs its attach first"

        nodes.upsert(node(in_use=(name,), attached=(name,)))
        await vm.reconcile()
        assert ops.started == [(("mount", "uid-app", "pv-data"), MOUNT)]
        assert len(client.patches) == 1

    asyncio.run(main())


def test_a_pass_unpublishes_what_no_pod_wants_then_unstages_it(tmp_path: Path) -> None:
    async def main() -> None:
        vm, factory, client, ops = manager(tmp_path)
        name = unique_volume_name(DRIVER, "v1")
        factory.informer(NODES, field_selector=f"metadata.name={NODE}").store.upsert(node(in_use=(name,)))
        vm.actual.mark_volume_mount_as_uncertain(published("gone", "v1"))
        vm.actual.mark_volume_as_mounted("gone", "pv-v1")
        vm.actual.mark_device_as_mounted((DRIVER, "v1"))

        await vm.reconcile()
        assert ops.started == [(("unpublish", "gone", "pv-v1"), UNPUBLISH)], "never unstaged under a publish"
        assert client.patches == [], "in use until unstaged"

        ops.started.clear()
        vm.actual.mark_volume_as_unmounted("gone", "pv-v1")
        await vm.reconcile()
        assert ops.started == [("unstage", UNSTAGE)]

    asyncio.run(main())


def test_a_pass_grows_a_mounted_volume_whose_claim_waits_for_the_node(tmp_path: Path) -> None:
    async def main() -> None:
        vm, factory, _, ops = manager(tmp_path)
        name = unique_volume_name(DRIVER, "data")
        nodes = factory.informer(NODES, field_selector=f"metadata.name={NODE}").store
        nodes.upsert(node(in_use=(name,), attached=(name,)))
        factory.informer(PODS, field_selector=pods_on_node(NODE)).store.upsert(pod("app", "data"))
        waiting = claim("data")
        waiting["status"].update(
            capacity={"storage": "1Gi"}, allocatedResourceStatuses={"storage": "NodeResizePending"}
        )
        factory.informer(PERSISTENT_VOLUME_CLAIMS).store.upsert(waiting)
        grown = volume("data")
        grown["spec"]["capacity"] = {"storage": "2Gi"}
        factory.informer(PERSISTENT_VOLUMES).store.upsert(grown)
        vm.actual.mark_volume_mount_as_uncertain(published("uid-app", "data"))
        vm.actual.mark_volume_as_mounted("uid-app", "pv-data")
        vm.actual.mark_device_as_mounted((DRIVER, "data"))

        await vm.reconcile()
        assert ops.started == [("expand", EXPAND)]

        ops.started.clear()
        vm.actual.mark_for_in_use_expansion_error((DRIVER, "data"))
        await vm.reconcile()
        assert ops.started == [], "grown offline at its next stage, not online again"

    asyncio.run(main())
