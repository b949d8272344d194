"""CSIStorageCapacity publishing (--enable-capacity): for every StorageClass of the driver and
every topology segment its nodes report, the driver's GetCapacity answer is kept in one
CSIStorageCapacity object, so the scheduler skips nodes whose pool cannot hold a new volume.

In node deployment a provisioner publishes its own node's segment only (from NodeGetInfo), under
its own managed-by label (`external-provisioner-<node>`), so the nodes' publishers never touch
each other's objects. With an owner (--capacity-ownerref-level) every object carries it as its
controlling owner reference, so uninstalling the driver removes them through garbage collection."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import grpc

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.events import EventRecorder
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.kinds import StorageClass, as_obj, csi_node_view, node_view, storage_class_view
from controller_runtime.logs import get_logger
from controller_runtime.metrics import Gauge
from controller_runtime.quantity import format_quantity
from controller_runtime.resources import CSI_STORAGE_CAPACITIES, Obj
from kubeloop_grpc.csi import csi_pb2

from . import names
from .request import Segment, driver_topology_keys, node_segment

log = get_logger("external-provisioner.capacity")


# Upstream's capacity controller gauges.
GOAL = Gauge(
    "csistoragecapacities_desired_goal",
    "Number of CSIStorageCapacity objects that are supposed to be managed automatically.",
)
CURRENT = Gauge(
    "csistoragecapacities_desired_current",
    "Number of CSIStorageCapacity objects that exist and are supposed to be managed automatically.",
)
OBSOLETE = Gauge(
    "csistoragecapacities_obsolete",
    "Number of CSIStorageCapacity objects that exist and will be deleted automatically.",
)


@dataclass(frozen=True)
class CapacityOptions:
    namespace: str
    interval: float = 60.0
    immediate_binding: bool = False  # upstream publishes only for WaitForFirstConsumer classes
    managed_by: str = names.CAPACITY_MANAGED_BY
    # Node deployment: the one segment to publish (empty: the driver reports no topology), instead
    # of every segment the cluster's CSINodes and Nodes make up.
    fixed_segment: Segment | None = None
    owner: Obj | None = None  # the controlling owner reference every object gets


def owned_by(obj: Obj, owner: Obj) -> bool:
    """Whether `owner` is the object's controlling owner (upstream's isOwnedByUs: by UID)."""
    return any(
        ref.get("controller") and ref.get("uid") == owner["uid"]
        for ref in obj.get("metadata", {}).get("ownerReferences") or []
    )


def _key(class_name: str, segment: Segment | None) -> tuple[str, str]:
    return class_name, json.dumps(segment or {}, sort_keys=True)


class CapacityPublisher:
    def __init__(
        self,
        client: ApiClient,
        conn: CSIConnection,
        classes: SharedInformer,
        csinodes: SharedInformer | None,
        nodes: SharedInformer | None,
        options: CapacityOptions,
        recorder: EventRecorder | None = None,
    ) -> None:
        self.client = client
        self.recorder = recorder
        self.conn = conn
        self.classes = classes
        self.csinodes = csinodes
        self.nodes = nodes
        self.options = options
        self.driver = conn.driver_name
        self.labels = {
            names.CAPACITY_LABEL_DRIVER: self.driver,
            names.CAPACITY_LABEL_MANAGED_BY: options.managed_by,
        }
        # A new class, a node plugin registering or a node relabelled changes which objects must
        # exist: publish at once, as upstream does, instead of at the next poll.
        self._changed = asyncio.Event()
        every_change = EventHandler(
            on_add=lambda _: self._changed.set(),
            on_update=lambda _old, _new: self._changed.set(),
            on_delete=lambda _: self._changed.set(),
        )
        classes.add_handler(every_change)
        if csinodes is not None:
            csinodes.add_handler(every_change)
        if nodes is not None:
            nodes.add_handler(
                EventHandler(
                    on_add=lambda _: self._changed.set(),
                    on_update=self._on_node_update,
                    on_delete=lambda _: self._changed.set(),
                )
            )

    def refresh_soon(self) -> None:
        """A volume was created or deleted: its segment's capacity changed. Upstream refreshes the
        segments of that volume at once rather than at the next poll, so the scheduler stops
        sending claims to a pool that just filled up; a burst coalesces into a round or two."""
        self._changed.set()

    def _on_node_update(self, old: Obj, new: Obj) -> None:
        # Status updates are frequent and never change a segment; labels are what segments are made of.
        if node_view(old)["metadata"].get("labels") != node_view(new)["metadata"].get("labels"):
            self._changed.set()

    def segments(self) -> list[Segment | None]:
        if not self.conn.has_plugin_capability(
            csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
        ):
            return [None]  # one pool for the whole cluster
        if self.options.fixed_segment is not None:
            return [dict(self.options.fixed_segment) or None]
        assert self.csinodes is not None and self.nodes is not None
        out: list[Segment | None] = []
        for obj in self.csinodes.store.values():
            csinode = csi_node_view(obj)
            keys = driver_topology_keys(csinode, self.driver)
            node = node_view(self.nodes.store.get(csinode["metadata"]["name"]))
            segment = node_segment(node, keys) if node is not None and keys else None
            if segment is not None and segment not in out:
                out.append(segment)
        return out

    def classes_to_publish(self) -> list[StorageClass]:
        return [
            c
            for c in map(storage_class_view, self.classes.store.values())
            if c.get("provisioner") == self.driver
            and (self.options.immediate_binding or c.get("volumeBindingMode") == "WaitForFirstConsumer")
        ]

    async def get_capacity(self, storage_class: StorageClass, segment: Segment | None) -> tuple[int, int]:
        params = {
            k: v
            for k, v in (storage_class.get("parameters") or {}).items()
            if not k.startswith(names.PARAMETER_PREFIX)
        }
        req = csi_pb2.GetCapacityRequest(parameters=params)
        if segment is not None:
            req.accessible_topology.CopyFrom(csi_pb2.Topology(segments=segment))
        rsp = await self.conn.controller.GetCapacity(req, timeout=self.conn.timeout)
        maximum = rsp.maximum_volume_size.value if rsp.HasField("maximum_volume_size") else 0
        return rsp.available_capacity, maximum

    def _object(self, class_name: str, segment: Segment | None, capacity: int, maximum: int) -> Obj:
        obj: Obj = {
            "metadata": {
                "generateName": "csisc-",
                "namespace": self.options.namespace,
                "labels": dict(self.labels),
            },
            "storageClassName": class_name,
            "capacity": format_quantity(capacity),
        }
        if segment is not None:
            obj["nodeTopology"] = {"matchLabels": dict(segment)}
        if maximum:
            obj["maximumVolumeSize"] = format_quantity(maximum)
        if self.options.owner is not None:
            obj["metadata"]["ownerReferences"] = [dict(self.options.owner)]
        return obj

    async def refresh(self) -> None:
        """One round: GetCapacity for each (class, segment), then create, update or delete objects
        so exactly one exists per pair."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))
        existing, _ = await self.client.list_all(
            CSI_STORAGE_CAPACITIES, self.options.namespace, labelSelector=selector
        )
        by_key: dict[tuple[str, str], Obj] = {}
        for obj in existing:
            key = _key(obj.get("storageClassName", ""), (obj.get("nodeTopology") or {}).get("matchLabels"))
            if key in by_key:
                await self._delete(obj)  # a duplicate, e.g. from a create whose answer was lost
            else:
                by_key[key] = obj
        wanted: set[tuple[str, str]] = set()
        current_count = 0
        for storage_class in self.classes_to_publish():
            class_name = storage_class["metadata"]["name"]
            for segment in self.segments():
                key = _key(class_name, segment)
                wanted.add(key)
                try:
                    capacity, maximum = await self.get_capacity(storage_class, segment)
                except grpc.aio.AioRpcError as exc:
                    log.warning(
                        "GetCapacity failed", storage_class=class_name, segment=key[1], error=exc.details()
                    )
                    self._refused(storage_class, segment, exc)
                    continue
                desired = self._object(class_name, segment, capacity, maximum)
                current = by_key.get(key)
                if current is None:
                    await self.client.create(CSI_STORAGE_CAPACITIES, desired, self.options.namespace)
                elif self._stale(current, desired):
                    await self.client.update(CSI_STORAGE_CAPACITIES, self._updated(current, desired))
                current_count += 1
        obsolete = [obj for key, obj in by_key.items() if key not in wanted]
        GOAL.set(len(wanted))
        CURRENT.set(current_count)
        OBSOLETE.set(len(obsolete))
        for obj in obsolete:
            await self._delete(obj)
        OBSOLETE.set(0)

    def _refused(
        self, storage_class: StorageClass, segment: Segment | None, exc: grpc.aio.AioRpcError
    ) -> None:
        """The driver refused the class's parameters (an unknown pool kind, say): without a
        capacity object the scheduler only tells the claim's pod "did not have enough free
        storage", so the cause goes on the class, where `kubectl describe storageclass` shows it.
        Upstream only logs it. A failed call (the driver down) is left to the log and the next round."""
        if self.recorder is None or exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
            return
        where = f" for {', '.join(f'{k}={v}' for k, v in sorted(segment.items()))}" if segment else ""
        self.recorder.warning(
            as_obj(storage_class),
            names.REASON_CAPACITY_FAILED,
            f"GetCapacity{where} failed: {exc.details()}; no storage capacity is published for this class "
            "there, so the scheduler places none of its WaitForFirstConsumer claims there",
        )

    def _stale(self, current: Obj, desired: Obj) -> bool:
        """Another capacity or maximum, or (with an owner) not controlled by it yet: an object
        published before ownership was configured gets the owner added, as upstream."""
        values = (current.get("capacity"), current.get("maximumVolumeSize"))
        if values != (desired["capacity"], desired.get("maximumVolumeSize")):
            return True
        return self.options.owner is not None and not owned_by(current, self.options.owner)

    def _updated(self, current: Obj, desired: Obj) -> Obj:
        """The current object (a copy: never the cached one) with the desired values."""
        updated = {**current, "capacity": desired["capacity"]}
        updated.pop("maximumVolumeSize", None)
        if "maximumVolumeSize" in desired:
            updated["maximumVolumeSize"] = desired["maximumVolumeSize"]
        owner = self.options.owner
        if owner is not None and not owned_by(current, owner):
            refs = list(current["metadata"].get("ownerReferences") or [])
            updated["metadata"] = {**current["metadata"], "ownerReferences": [*refs, dict(owner)]}
        return updated

    async def _delete(self, obj: Obj) -> None:
        try:
            await self.client.delete(CSI_STORAGE_CAPACITIES, obj["metadata"]["name"], self.options.namespace)
        except ApiError as exc:
            if not exc.not_found:
                raise

    async def run(self) -> None:
        """A round at start, then one per poll interval, or sooner when a class, CSINode or node
        changes (changes during a round bring the next one forward)."""
        while True:
            self._changed.clear()
            try:
                await self.refresh()
            except Exception as exc:  # a bad round must not stop publishing (nor the process)
                log.warning("capacity refresh failed", error=str(exc) or type(exc).__name__)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.options.interval)
