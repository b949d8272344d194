"""kcm's persistentvolume-binder metrics, same names and labels: the pv_collector_* gauges computed
from the caches at scrape time, and volume_operation_total_seconds for provision and delete."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controller_runtime import storage
from controller_runtime.resources import Obj
from controller_runtime.storage import claim_class, volume_class

OPERATION_SECONDS = Histogram(
    "volume_operation_total_seconds",
    "Storage operation end to end duration in seconds",
    ["plugin_name", "operation_name"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600),
)

Source = Callable[[], Iterable[Obj]]


def count_volumes(volumes: Iterable[Obj]) -> tuple[Counter[str], Counter[str]]:
    """(bound, unbound) volume counts by storage class; Bound means the Bound phase, as upstream."""
    bound: Counter[str] = Counter()
    unbound: Counter[str] = Counter()
    for pv in volumes:
        target = bound if pv.get("status", {}).get("phase") == storage.PV_BOUND else unbound
        target[volume_class(pv)] += 1
    return bound, unbound


def count_claims(claims: Iterable[Obj]) -> tuple[Counter[tuple[str, str]], Counter[tuple[str, str]]]:
    """(bound, unbound) claim counts by (namespace, storage class)."""
    bound: Counter[tuple[str, str]] = Counter()
    unbound: Counter[tuple[str, str]] = Counter()
    for pvc in claims:
        target = bound if pvc.get("status", {}).get("phase") == storage.CLAIM_BOUND else unbound
        target[(pvc.get("metadata", {}).get("namespace", ""), claim_class(pvc))] += 1
    return bound, unbound


class _CountCollector(Collector):
    """One registered collector; each running controller adds its caches as a source (tests run
    several controllers in one process, one after another)."""

    def __init__(self) -> None:
        self.sources: list[tuple[Source, Source]] = []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        pv_bound = GaugeMetricFamily(
            "pv_collector_bound_pv_count",
            "Gauge measuring number of persistent volume currently bound",
            labels=["storage_class"],
        )
        pv_unbound = GaugeMetricFamily(
            "pv_collector_unbound_pv_count",
            "Gauge measuring number of persistent volume currently unbound",
            labels=["storage_class"],
        )
        pvc_bound = GaugeMetricFamily(
            "pv_collector_bound_pvc_count",
            "Gauge measuring number of persistent volume claim currently bound",
            labels=["namespace", "storage_class"],
        )
        pvc_unbound = GaugeMetricFamily(
            "pv_collector_unbound_pvc_count",
            "Gauge measuring number of persistent volume claim currently unbound",
            labels=["namespace", "storage_class"],
        )
        for volumes, claims in self.sources:
            vb, vu = count_volumes(volumes())
            for cls, n in sorted(vb.items()):
                pv_bound.add_metric([cls], n)
            for cls, n in sorted(vu.items()):
                pv_unbound.add_metric([cls], n)
            cb, cu = count_claims(claims())
            for (ns, cls), n in sorted(cb.items()):
                pvc_bound.add_metric([ns, cls], n)
            for (ns, cls), n in sorted(cu.items()):
                pvc_unbound.add_metric([ns, cls], n)
        yield from (pv_bound, pv_unbound, pvc_bound, pvc_unbound)


COUNTS = _CountCollector()
REGISTRY.register(COUNTS)


@dataclass
class OperationTimer:
    """Start times of operations that finish in another sync (a handed-over provision ends with the
    bind; an external delete ends when the volume disappears), keyed by claim or volume."""

    started: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)

    def start(self, key: str, operation: str, plugin: str) -> None:
        self.started.setdefault((key, operation), (plugin, time.monotonic()))

    def finish(self, key: str, operation: str) -> None:
        entry = self.started.pop((key, operation), None)
        if entry is not None:
            plugin, t0 = entry
            OPERATION_SECONDS.labels(plugin, operation).observe(time.monotonic() - t0)

    def drop(self, key: str, operation: str) -> None:
        self.started.pop((key, operation), None)
