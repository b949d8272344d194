"""kcm's persistentvolume-binder metrics with kcm's names, labels, help texts and types, as a scrape
of kube-controller-manager 1.36 shows them:

- the pv_collector_* gauges, computed from the caches at scrape time;
- volume_operation_total_seconds (provision: hand-over to bind; delete: Released to gone) and
  volume_operation_total_errors, by plugin_name and operation_name;
- retroactive_storageclass_total and retroactive_storageclass_errors_total.

One collector produces all of them because the Counter and Histogram of controller_runtime.metrics
print as prometheus_client's do, not as client_golang does: a counter's name gets `_total` (kcm's
volume_operation_total_errors has no such suffix), every child adds a `_created` series kcm does not
have, and bucket bounds print as "1.0" where Go prints "1".
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from controller_runtime import storage
from controller_runtime.clock import SYSTEM_CLOCK, PassiveClock
from controller_runtime.metrics import (
    REGISTRY,
    CounterMetricFamily,
    Family,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from controller_runtime.resources import Obj
from controller_runtime.storage import volume_class

# component-base prefixes the help text of every metric by its stability level; all of these are ALPHA.
ALPHA = "[ALPHA] "
# What kcm reports as a plugin name it cannot determine.
NOT_AVAILABLE = "N/A"
# kcm's buckets for volume_operation_total_seconds, as Go formats them.
OPERATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 25, 50, 120, 300, 600)
# In-tree volume sources kcm's binder has a plugin for (its total_pv_count labels them by plugin);
# every other source, CSI included, is "N/A" there: the binder's plugin manager has no CSI plugin.
IN_TREE_PLUGINS = {"hostPath": "kubernetes.io/host-path", "nfs": "kubernetes.io/nfs"}

Source = Callable[[], Iterable[Obj]]


def _go_float(value: float) -> str:
    """A float as Go's strconv 'g' formatting prints a bucket bound: 1 not 1.0, 0.25 as is."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def volume_plugin_name(volume: Obj) -> str:
    spec = volume.get("spec", {})
    for source, plugin in IN_TREE_PLUGINS.items():
        if spec.get(source):
            return plugin
    return NOT_AVAILABLE


def count_volumes(volumes: Iterable[Obj]) -> tuple[Counter[str], Counter[str], Counter[tuple[str, str]]]:
    """(bound, unbound) volume counts by storage class (Bound means the Bound phase, as upstream),
    and all volumes by (plugin name, volume mode)."""
    bound: Counter[str] = Counter()
    unbound: Counter[str] = Counter()
    total: Counter[tuple[str, str]] = Counter()
    for pv in volumes:
        target = bound if pv.get("status", {}).get("phase") == storage.PV_BOUND else unbound
        target[volume_class(pv)] += 1
        mode = pv.get("spec", {}).get("volumeMode") or "Filesystem"  # the apiserver's default
        total[(volume_plugin_name(pv), mode)] += 1
    return bound, unbound, total


ClaimLabels = tuple[str, str, str]  # namespace, storage class, volume attributes class


def count_claims(claims: Iterable[Obj]) -> tuple[Counter[ClaimLabels], Counter[ClaimLabels]]:
    """(bound, unbound) claim counts by (namespace, storage class, volume attributes class); a nil
    class counts as "", as upstream dereferences it."""
    bound: Counter[ClaimLabels] = Counter()
    unbound: Counter[ClaimLabels] = Counter()
    for pvc in claims:
        spec = pvc.get("spec", {})
        target = bound if pvc.get("status", {}).get("phase") == storage.CLAIM_BOUND else unbound
        labels = (
            pvc.get("metadata", {}).get("namespace", ""),
            spec.get("storageClassName") or "",
            spec.get("volumeAttributesClassName") or "",
        )
        target[labels] += 1
    return bound, unbound


@dataclass
class _Histogram:
    buckets: list[int] = field(default_factory=lambda: [0] * len(OPERATION_BUCKETS))
    count: int = 0
    total: float = 0.0

    def observe(self, value: float) -> None:
        # Buckets are cumulative in the exposition; here each observation lands in its first one.
        i = bisect.bisect_left(OPERATION_BUCKETS, value)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.count += 1
        self.total += value


class BinderMetrics:
    """The registered collector. Each running controller adds its caches as a source (tests run
    several controllers in one process, one after another); the operation and retroactive-class
    figures are process-wide, as kcm's are."""

    def __init__(self) -> None:
        self.sources: list[tuple[Source, Source]] = []
        self.seconds: dict[tuple[str, str], _Histogram] = {}
        self.errors: Counter[tuple[str, str]] = Counter()
        self.retroactive = 0
        self.retroactive_errors = 0

    def observe_operation(self, plugin: str, operation: str, seconds: float) -> None:
        self.seconds.setdefault((plugin or NOT_AVAILABLE, operation), _Histogram()).observe(seconds)

    def operation_failed(self, plugin: str, operation: str) -> None:
        self.errors[(plugin or NOT_AVAILABLE, operation)] += 1

    def retroactive_assignment(self, success: bool) -> None:
        self.retroactive += 1
        if not success:
            self.retroactive_errors += 1

    def collect(self) -> Iterator[Family]:
        yield from self._counts()
        if self.seconds:
            seconds = HistogramMetricFamily(
                "volume_operation_total_seconds",
                ALPHA + "Storage operation end to end duration in seconds",
                labels=["plugin_name", "operation_name"],
            )
            for labels, h in sorted(self.seconds.items()):
                cumulative, running = [], 0
                for bound, n in zip(OPERATION_BUCKETS, h.buckets, strict=True):
                    running += n
                    cumulative.append((_go_float(bound), running))
                cumulative.append(("+Inf", h.count))
                seconds.add_metric(list(labels), cumulative, h.total)
            yield seconds
        if self.errors:
            # A Family as it is: kcm's counter has no `_total` (CounterMetricFamily would add one).
            name = "volume_operation_total_errors"
            errors = Family(name, ALPHA + "Total volume operation errors", "counter")
            for (plugin, operation), n in sorted(self.errors.items()):
                errors.samples.append((name, {"plugin_name": plugin, "operation_name": operation}, n))
            yield errors
        yield CounterMetricFamily(
            "retroactive_storageclass_total",
            ALPHA + "Total number of retroactive StorageClass assignments to persistent volume claim",
            value=self.retroactive,
        )
        yield CounterMetricFamily(
            "retroactive_storageclass_errors_total",
            ALPHA + "Total number of failed retroactive StorageClass assignments to persistent volume claim",
            value=self.retroactive_errors,
        )

    def _counts(self) -> Iterator[Family]:
        total_pv = GaugeMetricFamily(
            "pv_collector_total_pv_count",
            ALPHA + "Gauge measuring total number of persistent volumes",
            labels=["plugin_name", "volume_mode"],
        )
        pv_bound = GaugeMetricFamily(
            "pv_collector_bound_pv_count",
            ALPHA + "Gauge measuring number of persistent volume currently bound",
            labels=["storage_class"],
        )
        pv_unbound = GaugeMetricFamily(
            "pv_collector_unbound_pv_count",
            ALPHA + "Gauge measuring number of persistent volume currently unbound",
            labels=["storage_class"],
        )
        claim_labels = ["namespace", "storage_class", "volume_attributes_class"]
        pvc_bound = GaugeMetricFamily(
            "pv_collector_bound_pvc_count",
            ALPHA + "Gauge measuring number of persistent volume claim currently bound",
            labels=claim_labels,
        )
        pvc_unbound = GaugeMetricFamily(
            "pv_collector_unbound_pvc_count",
            ALPHA + "Gauge measuring number of persistent volume claim currently unbound",
            labels=claim_labels,
        )
        for volumes, claims in self.sources:
            vb, vu, vt = count_volumes(volumes())
            for (plugin, mode), n in sorted(vt.items()):
                total_pv.add_metric([plugin, mode], n)
            for cls, n in sorted(vb.items()):
                pv_bound.add_metric([cls], n)
            for cls, n in sorted(vu.items()):
                pv_unbound.add_metric([cls], n)
            cb, cu = count_claims(claims())
            for labels, n in sorted(cb.items()):
                pvc_bound.add_metric(list(labels), n)
            for labels, n in sorted(cu.items()):
                pvc_unbound.add_metric(list(labels), n)
        yield from (total_pv, pv_bound, pv_unbound, pvc_bound, pvc_unbound)


METRICS = BinderMetrics()
REGISTRY.register(METRICS)


@dataclass
class OperationTimer:
    """Start times of operations that finish in another sync (a handed-over provision ends with the
    bind; an external delete ends when the volume disappears), keyed by claim or volume, as kcm's
    operation timestamp cache: a failure counts an error and keeps the start time."""

    clock: PassiveClock = SYSTEM_CLOCK
    started: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)

    def start(self, key: str, operation: str, plugin: str) -> None:
        self.started.setdefault((key, operation), (plugin, self.clock.monotonic()))

    def finish(self, key: str, operation: str) -> None:
        entry = self.started.pop((key, operation), None)
        if entry is not None:
            plugin, t0 = entry
            METRICS.observe_operation(plugin, operation, self.clock.monotonic() - t0)

    def failed(self, key: str, operation: str) -> None:
        entry = self.started.get((key, operation))
        if entry is not None:
            METRICS.operation_failed(entry[0], operation)

    def drop(self, key: str, operation: str) -> None:
        self.started.pop((key, operation), None)
