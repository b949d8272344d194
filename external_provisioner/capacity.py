"""CSIStorageCapacity publishing (--enable-capacity): for every StorageClass of the driver and
every topology segment its nodes report, the driver's GetCapacity answer is kept in one
CSIStorageCapacity object, so the scheduler skips nodes whose pool cannot hold a new volume."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

import grpc

from controller_runtime.client import ApiClient, ApiError
from controller_runtime.csi_client import CSIConnection
from controller_runtime.informer import EventHandler, SharedInformer
from controller_runtime.logs import get_logger
from controller_runtime.quantity import format_quantity
from controller_runtime.resources import CSI_STORAGE_CAPACITIES, Obj
from kubeloop_grpc.csi import csi_pb2

from . import names
from .request import Segment, driver_topology_keys, node_segment

log = get_logger("external-provisioner.capacity")


@dataclass(frozen=True)
class CapacityOptions:
    namespace: str
    interval: float = 60.0
    immediate_binding: bool = False  # upstream publishes only for WaitForFirstConsumer classes


def _key(class_name: str, segment: Segment | None) -> tuple[str, str]:
    return class_name, json.dumps(segment or {}, sort_keys=True)


class CapacityPublisher:
    def __init__(
        self,
        client: ApiClient,
        conn: CSIConnection,
        classes: SharedInformer,
        csinodes: SharedInformer,
        nodes: SharedInformer,
        options: CapacityOptions,
    ) -> None:
        self.client = client
        self.conn = conn
        self.classes = classes
        self.csinodes = csinodes
        self.nodes = nodes
        self.options = options
        self.driver = conn.driver_name
        self.labels = {
            names.CAPACITY_LABEL_DRIVER: self.driver,
            names.CAPACITY_LABEL_MANAGED_BY: names.CAPACITY_MANAGED_BY,
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
        csinodes.add_handler(every_change)
        nodes.add_handler(
            EventHandler(
                on_add=lambda _: self._changed.set(),
                on_update=self._on_node_update,
                on_delete=lambda _: self._changed.set(),
            )
        )

    def _on_node_update(self, old: Obj, new: Obj) -> None:
        # Status updates are frequent and never change a segment; labels are what segments are made of.
        if old["metadata"].get("labels") != new["metadata"].get("labels"):
            self._changed.set()

    def segments(self) -> list[Segment | None]:
        if not self.conn.has_plugin_capability(
            csi_pb2.PluginCapability.Service.VOLUME_ACCESSIBILITY_CONSTRAINTS
        ):
            return [None]  # one pool for the whole cluster
        out: list[Segment | None] = []
        for csinode in self.csinodes.store.values():
            keys = driver_topology_keys(csinode, self.driver)
            node = self.nodes.store.get(csinode["metadata"]["name"])
            segment = node_segment(node, keys) if node is not None and keys else None
            if segment is not None and segment not in out:
                out.append(segment)
        return out

    def classes_to_publish(self) -> list[Obj]:
        return [
            c
            for c in self.classes.store.values()
            if c.get("provisioner") == self.driver
            and (self.options.immediate_binding or c.get("volumeBindingMode") == "WaitForFirstConsumer")
        ]

    async def get_capacity(self, storage_class: Obj, segment: Segment | None) -> tuple[int, int]:
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
                    continue
                desired = self._object(class_name, segment, capacity, maximum)
                current = by_key.get(key)
                if current is None:
                    await self.client.create(CSI_STORAGE_CAPACITIES, desired, self.options.namespace)
                elif (current.get("capacity"), current.get("maximumVolumeSize")) != (
                    desired["capacity"],
                    desired.get("maximumVolumeSize"),
                ):
                    current = dict(current)
                    current["capacity"] = desired["capacity"]
                    if "maximumVolumeSize" in desired:
                        current["maximumVolumeSize"] = desired["maximumVolumeSize"]
                    await self.client.update(CSI_STORAGE_CAPACITIES, current)
        for key, obj in by_key.items():
            if key not in wanted:
                await self._delete(obj)

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
