"""external-attacher decisions as csi-attacher v4.13 makes them, with the informer caches filled by
hand, an in-memory client recording writes and an in-memory CSI controller service: every
ControllerUnpublishVolume error (NotFound too) is retried, the trivial handler for a driver
without PUBLISH_UNPUBLISH_VOLUME, the node-id annotation and CSINode errors, the PV finalizer kept
until the PV is deleted, and the ListVolumes pass re-syncing VAs out of step in both directions."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.controller import ControllerContext
from controller_runtime.csi_client import CSIConnection, error_text
from controller_runtime.events import EventRecorder
from controller_runtime.informer import SharedInformerFactory
from controller_runtime.resources import Obj, Resource
from controller_runtime.volumes import attacher_finalizer
from external_attacher.controller import ANN_VA_NODE_ID, Attacher, AttachError, ControllerRPC, Options
from kubeloop_grpc.csi import csi_pb2

DRIVER = "loop.csi.kubeloop.dev"
FINALIZER = attacher_finalizer(DRIVER)
PUBLISHING = {ControllerRPC.PUBLISH_UNPUBLISH_VOLUME, ControllerRPC.LIST_VOLUMES}
PUBLISHING |= {ControllerRPC.LIST_VOLUMES_PUBLISHED_NODES}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


@dataclass
class Driver:
    """The controller service: answers from `published` (handle -> node ids) or raises `fail`."""

    published: dict[str, set[str]] = field(default_factory=dict)
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    fail: grpc.aio.AioRpcError | None = None
    readonly: list[bool] = field(default_factory=list)

    async def ControllerPublishVolume(self, req: Any, timeout: float) -> Any:
        self.calls.append(("publish", req.volume_id, req.node_id))
        self.readonly.append(req.readonly)
        if self.fail:
            raise self.fail
        self.published.setdefault(req.volume_id, set()).add(req.node_id)
        return csi_pb2.ControllerPublishVolumeResponse(publish_context={"k": "v"})

    async def ControllerUnpublishVolume(self, req: Any, timeout: float) -> Any:
        self.calls.append(("unpublish", req.volume_id, req.node_id))
        if self.fail:
            raise self.fail
        self.published.get(req.volume_id, set()).discard(req.node_id)
        return csi_pb2.ControllerUnpublishVolumeResponse()

    async def ListVolumes(self, req: Any, timeout: float) -> Any:
        entries = [
            csi_pb2.ListVolumesResponse.Entry(
                volume=csi_pb2.Volume(volume_id=handle),
                status=csi_pb2.ListVolumesResponse.VolumeStatus(published_node_ids=sorted(nodes)),
            )
            for handle, nodes in self.published.items()
        ]
        return csi_pb2.ListVolumesResponse(entries=entries)


class Connection(CSIConnection):
    fake: Driver

    @property
    def controller(self) -> Any:
        return self.fake


def merged_metadata(obj: Obj, patch: Obj) -> Obj:
    """`obj` with a merge patch of its metadata applied (finalizers whole, annotations by key)."""
    out = copy.deepcopy(obj)
    md, change = out["metadata"], patch["metadata"]
    if "finalizers" in change:
        md["finalizers"] = list(change["finalizers"])
    if "annotations" in change:
        md["annotations"] = {**(md.get("annotations") or {}), **change["annotations"]}
    return out


@dataclass
class Writes:
    calls: list[tuple[str, str, Obj]] = field(default_factory=list)
    listed: list[Obj] = field(default_factory=list)
    stores: dict[str, Any] = field(default_factory=dict)

    async def update(self, res: Resource, body: Obj, **_: Any) -> Obj:
        self.calls.append(("update", res.plural, body))
        return body

    async def patch(self, res: Resource, name: str, body: Obj, **kw: Any) -> Obj:
        if kw.get("subresource") != "status":
            # A merge patch of metadata (finalizers, annotations), recorded as "meta"; the API
            # answers with the whole object patched.
            self.calls.append(("meta", res.plural, body))
            return merged_metadata(self.stores[res.plural].get(name) or {"metadata": {"name": name}}, body)
        self.calls.append(("patch", res.plural, body))
        # The API answers with the object, which names itself (no resourceVersion here: any
        # cached copy counts as newer).
        return {**body, "metadata": {"name": name, **body.get("metadata", {})}}

    async def list_all(self, _res: Resource) -> tuple[list[Obj], str]:
        return self.listed, "1"

    def of(self, verb: str, plural: str) -> list[Obj]:
        return [body for v, p, body in self.calls if (v, p) == (verb, plural)]


def make(capabilities: set[int] = PUBLISHING) -> tuple[Attacher, Driver, Writes]:
    driver, writes = Driver(), Writes()
    conn = Connection(address="unix:///x", timeout=1.0, channel=cast(Any, None), driver_name=DRIVER)
    conn.controller_capabilities = set(capabilities)
    conn.fake = driver
    client = cast(ApiClient, writes)
    context = ControllerContext(client, SharedInformerFactory(client), cast(EventRecorder, None))
    attacher = Attacher(context, conn)
    writes.stores = {"volumeattachments": attacher.vas.store, "persistentvolumes": attacher.pvs.store}
    return attacher, driver, writes


def pv(deleting: bool = False, finalizers: tuple[str, ...] = (), read_only: bool = False) -> Obj:
    md: Obj = {"name": "pv-1", "finalizers": list(finalizers)}
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    csi = {"driver": DRIVER, "volumeHandle": "vol-1", "readOnly": read_only}
    return {"metadata": md, "spec": {"accessModes": ["ReadWriteOnce"], "csi": csi}}


def va(
    attached: bool = False,
    deleting: bool = False,
    finalizers: tuple[str, ...] = (),
    node_id_annotation: str | None = None,
) -> Obj:
    md: Obj = {"name": "va-1", "finalizers": list(finalizers)}
    if deleting:
        md["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if node_id_annotation is not None:
        md["annotations"] = {ANN_VA_NODE_ID: node_id_annotation}
    return {
        "metadata": md,
        "spec": {"attacher": DRIVER, "nodeName": "node-a", "source": {"persistentVolumeName": "pv-1"}},
        "status": {"attached": attached},
    }


def csinode(node_id: str = "id-a") -> Obj:
    return {"metadata": {"name": "node-a"}, "spec": {"drivers": [{"name": DRIVER, "nodeID": node_id}]}}


def errors(writes: Writes, field_name: str) -> list[str]:
    return [
        b["status"][field_name]["message"]
        for b in writes.of("patch", "volumeattachments")
        if field_name in b["status"]
    ]


def test_not_found_from_unpublish_is_an_error_to_retry() -> None:
    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
        a.csinodes.store.upsert(csinode())
        a.vas.store.upsert(va(attached=True, deleting=True, finalizers=(FINALIZER,)))
        driver.fail = rpc_error(grpc.StatusCode.NOT_FOUND, "no volume vol-1")
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        assert errors(writes, "detachError") == ["rpc error: code = NotFound desc = no volume vol-1"]
        assert not writes.of("meta", "volumeattachments"), "the finalizer stays"

        driver.fail = None
        patches = len(writes.of("patch", "volumeattachments"))
        await a.sync_va("va-1")
        [update] = writes.of("meta", "volumeattachments")
        assert update["metadata"]["finalizers"] == []
        # Its last finalizer gone, the deleted VA is gone too: no status write after it
        # (csi-attacher sends one and ignores its 404).
        assert len(writes.of("patch", "volumeattachments")) == patches

    asyncio.run(main())


@pytest.mark.parametrize(
    ("code", "state"),
    [
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Background"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "Background"),  # isFinalError: a busy driver
        (grpc.StatusCode.INVALID_ARGUMENT, "Finished"),
    ],
)
def test_a_failed_publish_is_retried_whatever_it_left_and_logs_its_state(
    code: grpc.StatusCode, state: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv())
        a.csinodes.store.upsert(csinode())
        a.vas.store.upsert(va())
        driver.fail = failure = rpc_error(code, "no")
        with caplog.at_level("INFO", logger="external-attacher"), pytest.raises(AttachError):
            await a.sync_va("va-1")
        [record] = [r for r in caplog.records if r.getMessage() == "ControllerPublishVolume failed"]
        assert vars(record)["kubeloop_fields"]["state"] == state
        assert errors(writes, "attachError") == [error_text(failure)]

        driver.fail = None
        await a.sync_va("va-1")
        assert writes.of("patch", "volumeattachments")[-1]["status"]["attached"] is True

    asyncio.run(main())


def test_a_detached_va_another_finalizer_holds_says_so_in_its_status() -> None:
    async def main() -> None:
        a, _driver, writes = make()
        a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
        a.csinodes.store.upsert(csinode())
        a.vas.store.upsert(va(attached=True, deleting=True, finalizers=("example.com/other", FINALIZER)))
        await a.sync_va("va-1")
        [update] = writes.of("meta", "volumeattachments")
        assert update["metadata"]["finalizers"] == ["example.com/other"]
        assert writes.of("patch", "volumeattachments")[-1]["status"] == {
            "attached": False,
            "detachError": None,
            "attachmentMetadata": None,
        }

    asyncio.run(main())


def test_driver_without_publish_gets_the_trivial_handler() -> None:
    async def main() -> None:
        a, driver, writes = make(capabilities=set())
        a.pvs.store.upsert(pv())
        a.vas.store.upsert(va())
        await a.sync_va("va-1")
        assert [c[:2] for c in writes.calls] == [("patch", "volumeattachments")]
        marked = {"attached": True, "attachmentMetadata": None, "attachError": None}
        assert writes.calls[0][2]["status"] == marked
        assert not driver.calls

        a.pvs.store.upsert(pv(deleting=True, finalizers=(FINALIZER,)))
        writes.calls.clear()
        await a.sync_pv("pv-1")
        assert not writes.calls, "the trivial handler leaves PVs alone"

    asyncio.run(main())


def test_attach_records_node_id_and_needs_a_csinode() -> None:
    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv(read_only=True))
        a.vas.store.upsert(va())
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        assert errors(writes, "attachError") == ['csinode.storage.k8s.io "node-a" not found']
        assert [b["metadata"]["finalizers"] for b in writes.of("meta", "persistentvolumes")] == [[FINALIZER]]
        assert not writes.of("meta", "volumeattachments"), "no VA finalizer without a node id"

        a.csinodes.store.upsert({"metadata": {"name": "node-a"}, "spec": {"drivers": []}})
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        assert errors(writes, "attachError")[-1] == f"CSINode node-a does not contain driver {DRIVER}"

        a.csinodes.store.upsert(csinode())
        writes.calls.clear()
        await a.sync_va("va-1")
        [update] = writes.of("meta", "volumeattachments")
        assert update["metadata"]["finalizers"] == [FINALIZER]
        assert update["metadata"]["annotations"] == {ANN_VA_NODE_ID: "id-a"}
        assert driver.calls[-1] == ("publish", "vol-1", "id-a")
        assert driver.readonly[-1] is False, "the driver lacks PUBLISH_READONLY"

    asyncio.run(main())


def test_detach_without_csinode_uses_the_recorded_node_id() -> None:
    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
        a.vas.store.upsert(va(attached=True, deleting=True, finalizers=(FINALIZER,)))
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        assert errors(writes, "detachError") == ['csinode.storage.k8s.io "node-a" not found']
        assert not driver.calls
        a.vas.store.upsert(
            va(attached=True, deleting=True, finalizers=(FINALIZER,), node_id_annotation="id-a")
        )
        await a.sync_va("va-1")
        assert driver.calls == [("unpublish", "vol-1", "id-a")]

    asyncio.run(main())


def test_pv_finalizer_is_kept_until_the_pv_is_deleted() -> None:
    async def main() -> None:
        a, _driver, writes = make()
        a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
        await a.sync_pv("pv-1")
        assert not writes.calls, "no VA names it, yet the PV is not being deleted"
        a.pvs.store.upsert(pv(deleting=True, finalizers=(FINALIZER,)))
        other = va()
        other["spec"]["attacher"] = "other.driver"
        a.vas.store.upsert(other)
        await a.sync_pv("pv-1")
        assert not writes.calls, "a VA of any driver still names it"
        a.vas.store.delete("va-1")
        await a.sync_pv("pv-1")
        [update] = writes.of("meta", "persistentvolumes")
        assert update["metadata"]["finalizers"] == []

    asyncio.run(main())


def test_list_volumes_resyncs_attachments_out_of_step_both_ways() -> None:
    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
        a.csinodes.store.upsert(csinode())
        # Attached per its status, but the driver lost the publication: published again.
        a.vas.store.upsert(va(attached=True, finalizers=(FINALIZER,), node_id_annotation="id-a"))
        assert await a.reconcile_published() == 1
        assert not writes.calls, "the pass itself writes nothing"
        await a.sync_va("va-1")
        assert driver.calls == [("publish", "vol-1", "id-a")]
        assert await a.reconcile_published() == 0

        # Being deleted, finalizer already gone, still published: unpublished again.
        a.vas.store.upsert(va(attached=False, deleting=True, node_id_annotation="id-a"))
        await a.sync_va("va-1")
        assert driver.calls[-1][0] == "publish", "without the finalizer a deleted VA counts as detached"
        assert await a.reconcile_published() == 1
        await a.sync_va("va-1")
        assert driver.calls[-1] == ("unpublish", "vol-1", "id-a")

    asyncio.run(main())


def test_a_lost_race_for_the_pv_finalizer_is_no_attach_error() -> None:
    """ReadOnlyMany on two nodes: both VAs add the same PV finalizer at once, one patch (naming the
    resourceVersion read) gets 409. The loser reads the PV again and finds the finalizer there; no
    attachError, the attach goes on."""

    async def main() -> None:
        a, driver, writes = make()
        a.pvs.store.upsert(pv())
        a.csinodes.store.upsert(csinode())
        a.vas.store.upsert(va())
        won_by_other = pv(finalizers=(FINALIZER,))

        patch = writes.patch

        async def conflicting(res: Resource, name: str, body: Obj, **kw: Any) -> Obj:
            if res.plural == "persistentvolumes":
                writes.calls.append(("meta", res.plural, body))
                raise ApiError(409, {"message": 'Operation cannot be fulfilled on persistentvolumes "pv-1"'})
            return await patch(res, name, body, **kw)

        async def get(res: Resource, name: str, namespace: str | None = None) -> Obj:
            return won_by_other

        writes.patch = conflicting  # type: ignore[method-assign]
        writes.get = get  # type: ignore[attr-defined]
        await a.sync_va("va-1")
        [marked] = writes.of("patch", "volumeattachments")
        assert marked["status"]["attached"] is True and marked["status"]["attachError"] is None
        assert driver.calls == [("publish", "vol-1", "id-a")]
        assert len(writes.of("meta", "persistentvolumes")) == 1

    asyncio.run(main())


class Versioned(Writes):
    """Answers writes as the apiserver does: the whole object at a new resourceVersion."""

    def __init__(self, first: Obj) -> None:
        super().__init__()
        self.held = copy.deepcopy(first)

    def _next(self, obj: Obj) -> Obj:
        obj["metadata"]["resourceVersion"] = str(int(self.held["metadata"]["resourceVersion"]) + 1)
        self.held = copy.deepcopy(obj)
        return obj

    async def patch(self, res: Resource, name: str, body: Obj, **kw: Any) -> Obj:
        if kw.get("subresource") != "status":
            written = self._next(merged_metadata(self.held, body))
            self.calls.append(("meta", res.plural, copy.deepcopy(written)))  # the object it left
            return written
        await super().patch(res, name, body, **kw)
        obj = copy.deepcopy(self.held)
        obj["status"] = {**obj.get("status", {}), **body["status"]}
        return self._next(obj)


async def attached_through_versioned_writes() -> tuple[Attacher, Driver, Versioned]:
    """An attacher that attached va-1 (at resourceVersion 10 in its cache) through `Versioned`."""
    first = va()
    first["metadata"]["resourceVersion"] = "10"
    a, driver, _ = make()
    writes = Versioned(first)
    a.client = cast(ApiClient, writes)
    a.pvs.store.upsert(pv(finalizers=(FINALIZER,)))
    a.csinodes.store.upsert(csinode())
    a.vas.store.upsert(first)
    await a.sync_va("va-1")
    return a, driver, writes


def deleted(held: Obj, resource_version: str) -> Obj:
    obj = copy.deepcopy(held)
    obj["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj["metadata"]["resourceVersion"] = resource_version
    return obj


def test_a_sync_from_a_cache_behind_our_own_writes_does_not_attach_again() -> None:
    """The finalizer write's event queues the VA while its attach runs; the cache that sync reads
    has the finalizer but not yet the status write. csi-attacher decides from its lister's copy
    alone, so it attaches again (ControllerPublishVolume and the status patch once more); kubeloop
    goes by its own newer write."""

    async def main() -> None:
        a, driver, writes = await attached_through_versioned_writes()
        assert [c[0] for c in driver.calls] == ["publish"]
        [finalizer_written] = writes.of("meta", "volumeattachments")

        a.vas.store.upsert(finalizer_written)  # the cache at the finalizer write, not the status's
        await a.sync_va("va-1")
        assert [c[0] for c in driver.calls] == ["publish"], "attached once"
        assert len(writes.calls) == 2, "no second status patch"

        a.vas.store.upsert(deleted(writes.held, "20"))  # the cache catches up, then the VA is deleted
        await a.sync_va("va-1")
        assert [c[0] for c in driver.calls] == ["publish", "unpublish"], "a newer cache wins"

    asyncio.run(main())


def test_a_cached_deletion_wins_over_our_write_whatever_the_versions_say() -> None:
    """Should resourceVersions ever go backwards (etcd restored from a backup), a deleted VA is still
    detached rather than held by the copy of our own last write."""

    async def main() -> None:
        a, driver, writes = await attached_through_versioned_writes()
        a.vas.store.upsert(deleted(writes.held, "3"))
        await a.sync_va("va-1")
        assert [c[0] for c in driver.calls] == ["publish", "unpublish"]

    asyncio.run(main())


def error_codes(writes: Writes) -> list[tuple[str, int | None]]:
    return [
        (name, b["status"][name].get("errorCode"))
        for b in writes.of("patch", "volumeattachments")
        for name in ("attachError", "detachError")
        if b["status"].get(name)
    ]


@pytest.mark.parametrize("gate", [True, False])
def test_a_failed_publish_carries_its_grpc_code_with_the_mutable_allocatable_count_gate(gate: bool) -> None:
    """csi-attacher's MutableCSINodeAllocatableCount (GA, on): attachError.errorCode is the failed
    call's gRPC code (kubelet reads ResourceExhausted); an error of no call, and every detach
    error, carry none."""

    async def main() -> None:
        a, driver, writes = make()
        a.options = Options(error_code=gate)
        a.pvs.store.upsert(pv())
        a.vas.store.upsert(va())
        with pytest.raises(AttachError):
            await a.sync_va("va-1")  # no CSINode: not the driver's answer
        a.csinodes.store.upsert(csinode())
        driver.fail = rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many volumes")
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        a.vas.store.upsert(va(attached=True, deleting=True, finalizers=(FINALIZER,)))
        with pytest.raises(AttachError):
            await a.sync_va("va-1")
        code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] if gate else None
        assert error_codes(writes) == [("attachError", None), ("attachError", code), ("detachError", None)]

    asyncio.run(main())


@pytest.mark.parametrize(
    ("fs_type", "block", "want"), [("", False, "ext4"), ("xfs", False, "xfs"), ("", True, None)]
)
def test_default_fstype_fills_a_filesystem_pv_naming_none(
    fs_type: str, block: bool, want: str | None
) -> None:
    async def main() -> None:
        a, driver, _writes = make()
        a.options = Options(default_fstype="ext4")
        seen: list[Any] = []
        publish = driver.ControllerPublishVolume

        async def recording(req: Any, timeout: float) -> Any:
            seen.append(req.volume_capability)
            return await publish(req, timeout)

        driver.ControllerPublishVolume = recording  # type: ignore[method-assign]
        volume = pv()
        volume["spec"]["csi"]["fsType"] = fs_type
        if block:
            volume["spec"]["volumeMode"] = "Block"
        a.pvs.store.upsert(volume)
        a.csinodes.store.upsert(csinode())
        a.vas.store.upsert(va())
        await a.sync_va("va-1")
        [cap] = seen
        assert (cap.mount.fs_type if cap.HasField("mount") else None) == want

    asyncio.run(main())
