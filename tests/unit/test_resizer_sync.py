"""external-resizer syncs as csi-resizer v2.3.0 runs them, with the informer caches filled by hand,
an in-memory client that applies merge patches to its own copies, and an in-memory controller
service: the PV's pre-resize-capacity annotation (set with the new capacity when the node must
still grow the filesystem, kept while it is there, removed once the claim caught up)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any, cast

from controller_runtime import resize_status as rs
from controller_runtime.client import ApiClient
from controller_runtime.clock_testing import FakeClock
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import Obj, Resource
from external_resizer.controller import ControllerRPC, Options, Resizer
from kubeloop_grpc.csi import csi_pb2

DRIVER = "loop.csi.kubeloop.dev"
GI = 1 << 30


def merge(target: Obj, patch: Obj) -> Obj:
    """RFC 7386 JSON merge patch."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclass
class Api:
    """The client: keeps PVs and claims by name, applies patches, records them."""

    objects: dict[tuple[str, str], Obj] = field(default_factory=dict)
    patches: list[tuple[str, str, Obj]] = field(default_factory=list)
    revision: int = 100

    async def patch(self, res: Resource, name: str, body: Obj, *_: Any, **__: Any) -> Obj:
        self.patches.append((res.plural, name, body))
        body = {k: v for k, v in body.items() if k != "metadata"} | {
            "metadata": {k: v for k, v in (body.get("metadata") or {}).items() if k != "resourceVersion"}
        }
        obj = merge(self.objects[(res.plural, name)], body)
        # Every write gets a newer resourceVersion, as the apiserver gives it.
        self.revision += 1
        obj["metadata"] = {**obj.get("metadata", {}), "resourceVersion": str(self.revision)}
        self.objects[(res.plural, name)] = obj
        return obj

    def of(self, plural: str) -> list[Obj]:
        return [body for p, _, body in self.patches if p == plural]


@dataclass
class Driver:
    node_expansion: bool = True

    async def ControllerExpandVolume(self, req: Any, timeout: float) -> Any:
        return csi_pb2.ControllerExpandVolumeResponse(
            capacity_bytes=req.capacity_range.required_bytes, node_expansion_required=self.node_expansion
        )


class Connection(CSIConnection):
    fake: Driver

    @property
    def controller(self) -> Any:
        return self.fake


class Events:
    def normal(self, obj: Obj, reason: str, message: str) -> None:
        pass

    def warning(self, obj: Obj, reason: str, message: str) -> None:
        pass


def claim(request: int, capacity: int) -> Obj:
    return {
        "metadata": {"namespace": "ns", "name": "c", "uid": "cu", "resourceVersion": "1"},
        "spec": {"volumeName": "pv", "resources": {"requests": {"storage": str(request)}}},
        "status": {"phase": "Bound", "capacity": {"storage": f"{capacity // GI}Gi"}},
    }


def volume(size: int, annotations: dict[str, str] | None = None) -> Obj:
    return {
        "metadata": {"name": "pv", "annotations": annotations or {}},
        "spec": {
            "capacity": {"storage": str(size)},
            "accessModes": ["ReadWriteOnce"],  # the apiserver requires one; CSI needs it
            "csi": {"driver": DRIVER, "volumeHandle": "h"},
            "claimRef": {"namespace": "ns", "name": "c", "uid": "cu"},
        },
    }


class World:
    def __init__(self, pv: Obj, pvc: Obj, node_expansion: bool = True) -> None:
        self.clock = FakeClock()
        self.api = Api({("persistentvolumes", "pv"): pv, ("persistentvolumeclaims", "c"): pvc})
        conn = Connection(address="unix:///x", timeout=1.0, channel=cast(Any, None), driver_name=DRIVER)
        conn.controller_capabilities = {ControllerRPC.EXPAND_VOLUME}
        conn.fake = Driver(node_expansion)
        client = cast(ApiClient, self.api)
        context = ControllerContext(
            client, SharedInformerFactory(client), cast(EventRecorder, Events()), self.clock
        )
        self.r = Resizer(context, conn, Options(handle_volume_in_use_error=False))
        self.r.volumes.store.upsert(pv)
        self.r.claims.store.upsert(pvc)

    def sync(self) -> float | None:
        return asyncio.run(self.r.sync("ns/c"))

    @property
    def pv(self) -> Obj:
        return self.api.objects[("persistentvolumes", "pv")]


def test_annotation_records_the_claims_capacity_with_the_grown_pv() -> None:
    w = World(volume(GI), claim(2 * GI, GI))
    w.sync()
    (pv_patch,) = w.api.of("persistentvolumes")
    assert pv_patch == {
        "spec": {"capacity": {"storage": "2Gi"}},
        "metadata": {"annotations": {rs.PRE_RESIZE_CAPACITY: "1Gi"}},
    }, "one patch, capacity and annotation together"
    assert w.r.volume_view.get("pv") == w.pv, (
        "the cache, read through the own-writes overlay, holds what was written"
    )


def test_no_annotation_when_the_node_has_nothing_to_do() -> None:
    w = World(volume(GI), claim(2 * GI, GI), node_expansion=False)
    w.sync()
    assert w.api.of("persistentvolumes") == [{"spec": {"capacity": {"storage": "2Gi"}}}]


def test_an_existing_annotation_keeps_the_first_size() -> None:
    # A second growth while the node has not finished the first: 1Gi stays the size before.
    w = World(volume(2 * GI, {rs.PRE_RESIZE_CAPACITY: "1Gi"}), claim(3 * GI, GI))
    w.sync()
    assert w.api.of("persistentvolumes") == [{"spec": {"capacity": {"storage": "3Gi"}}}]
    assert w.pv["metadata"]["annotations"] == {rs.PRE_RESIZE_CAPACITY: "1Gi"}


def test_annotation_removed_once_the_claim_caught_up() -> None:
    w = World(volume(2 * GI, {rs.PRE_RESIZE_CAPACITY: "1Gi"}), claim(2 * GI, 2 * GI))
    w.sync()
    assert w.api.of("persistentvolumes") == [{"metadata": {"annotations": {rs.PRE_RESIZE_CAPACITY: None}}}]
    assert w.pv["metadata"]["annotations"] == {}
    assert not w.api.of("persistentvolumeclaims"), "nothing else to do"


def test_annotation_stays_while_the_node_is_behind() -> None:
    w = World(volume(2 * GI, {rs.PRE_RESIZE_CAPACITY: "1Gi"}), claim(2 * GI, GI))
    w.r.claims.store.upsert(
        merge(claim(2 * GI, GI), {"status": {"allocatedResourceStatuses": {"storage": rs.NODE_PENDING}}})
    )
    w.sync()
    assert w.api.of("persistentvolumes") == []


def test_an_infeasible_size_is_tried_again_only_after_the_retry_interval_max() -> None:
    pvc = claim(2 * GI, GI)
    pvc["status"]["allocatedResources"] = {"storage": "2Gi"}
    pvc["status"]["allocatedResourceStatuses"] = {"storage": rs.CONTROLLER_INFEASIBLE}
    w = World(volume(GI), pvc)
    assert w.sync() == 300.0, "polled again after --retry-interval-max, on the controller's clock"
    w.clock.step(299.5)
    assert w.sync() == 0.5 and w.api.patches == [], "not tried again before"
    w.clock.step(0.5)
    assert w.sync() is None
    assert w.api.of("persistentvolumes") == [
        {
            "spec": {"capacity": {"storage": "2Gi"}},
            "metadata": {"annotations": {rs.PRE_RESIZE_CAPACITY: "1Gi"}},
        }
    ], "tried again once the interval passed"
