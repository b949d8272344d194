"""Prometheus metrics for every kubeloop process, without prometheus_client.

prometheus_client cost each process 3.6 MiB of anonymous memory and 4.4 of RSS at import, most of
it the standard library's http.server, urllib.request, email and wsgiref that its exposition module
imports for servers and push gateways kubeloop never uses (issue 49). Its metric types are small;
what is kept of them here is what kubeloop's processes use: labeled or plain counters, gauges and
histograms, the metric families a collector builds at scrape time, and one registry per process.

The text is prometheus_client's `generate_latest`, line for line, so scrapes, dashboards and alerts
see the same families: HELP and TYPE, labels sorted by name, values as Go prints floats, a counter
or histogram's `_created` as a gauge family after it, a counter's samples and header with `_total`,
and the default registry's `python_gc_*`, `python_info` and `process_*` families first. Counts and
values change under a lock: node-driver-registrar and livenessprobe update them from threads.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

# prometheus_client's CONTENT_TYPE_LATEST.
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)


def go_float(value: float) -> str:
    """A value as prometheus_client's floatToGoString writes it: `5.0`, `0.005`, `1.79e+09`, `+Inf`."""
    if value == math.inf:
        return "+Inf"
    if value == -math.inf:
        return "-Inf"
    if math.isnan(value):
        return "NaN"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:  # Go switches to exponents sooner than Python
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


@dataclass
class Family:
    """One metric family as a scrape writes it: name, help, type (counter, gauge, histogram or
    untyped) and samples (name, labels, value)."""

    name: str
    help: str
    type: str
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def text(self) -> str:
        escaped = self.help.replace("\\", r"\\").replace("\n", r"\n")
        lines = [f"# HELP {self.name} {escaped}\n# TYPE {self.name} {self.type}\n"]
        for name, labels, value in self.samples:
            pairs = ",".join(f'{key}="{_escape(val)}"' for key, val in sorted(labels.items()))
            lines.append(f"{name}{{{pairs}}} {go_float(value)}\n" if pairs else f"{name} {go_float(value)}\n")
        return "".join(lines)


class GaugeMetricFamily(Family):
    """A gauge family a collector builds at scrape time: one `value`, or `add_metric` per labels."""

    def __init__(self, name: str, help: str, value: float | None = None, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, "gauge")
        self._labels = tuple(labels)
        if value is not None:
            self.samples.append((name, {}, value))

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append((self.name, dict(zip(self._labels, labels, strict=True)), value))


class CounterMetricFamily(Family):
    """A counter family built at scrape time; its samples are named `<name>_total`."""

    def __init__(self, name: str, help: str, value: float | None = None, labels: Sequence[str] = ()) -> None:
        super().__init__(name.removesuffix("_total") + "_total", help, "counter")
        self._labels = tuple(labels)
        if value is not None:
            self.samples.append((self.name, {}, value))

    def add_metric(self, labels: Sequence[str], value: float) -> None:
        self.samples.append((self.name, dict(zip(self._labels, labels, strict=True)), value))


class HistogramMetricFamily(Family):
    """A histogram family built at scrape time: per labels, cumulative `(le, count)` buckets (the
    last `+Inf`) and the sum."""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help, "histogram")
        self._labels = tuple(labels)

    def add_metric(
        self, labels: Sequence[str], buckets: Sequence[tuple[str, float]], sum_value: float
    ) -> None:
        base = dict(zip(self._labels, labels, strict=True))
        for bound, count in buckets:
            self.samples.append((f"{self.name}_bucket", {**base, "le": bound}, count))
        self.samples.append((f"{self.name}_count", base, buckets[-1][1]))
        self.samples.append((f"{self.name}_sum", base, sum_value))


class UntypedMetricFamily(Family):
    """A family of no declared type (prometheus_client's Metric of type "unknown")."""

    def __init__(self, name: str, help: str) -> None:
        super().__init__(name, help, "untyped")

    def add_sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.samples.append((name, labels, value))


class Collector(Protocol):
    def collect(self) -> Iterable[Family]: ...


class _GC:
    """prometheus_client's GCCollector."""

    def collect(self) -> Iterator[Family]:
        stats = gc.get_stats()
        for stat, name, help, kind in (
            ("collected", "python_gc_objects_collected", "Objects collected during gc", "counter"),
            (
                "uncollectable",
                "python_gc_objects_uncollectable",
                "Uncollectable objects found during GC",
                "counter",
            ),
            (
                "collections",
                "python_gc_collections",
                "Number of times this generation was collected",
                "counter",
            ),
        ):
            yield Family(
                f"{name}_total",
                help,
                kind,
                [(f"{name}_total", {"generation": str(g)}, values[stat]) for g, values in enumerate(stats)],
            )


class _Platform:
    """prometheus_client's PlatformCollector on CPython (without importing `platform`)."""

    def collect(self) -> Iterator[Family]:
        major, minor, micro = (str(part) for part in sys.version_info[:3])
        implementation = {"cpython": "CPython", "pypy": "PyPy"}.get(
            sys.implementation.name, sys.implementation.name
        )
        labels = {"implementation": implementation, "major": major, "minor": minor, "patchlevel": micro}
        labels["version"] = sys.version.split()[0]
        yield Family("python_info", "Python platform information", "gauge", [("python_info", labels, 1)])


def _boot_time() -> float:
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    return 0.0


class _Process:
    """prometheus_client's ProcessCollector, from /proc/self as it reads it."""

    def collect(self) -> Iterator[Family]:
        try:
            btime, ticks, page = _boot_time(), os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
            with open("/proc/self/stat", "rb") as f:
                parts = f.read().split(b")")[-1].split()
        except OSError:
            return
        for name, help, kind, value in (
            ("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", float(parts[20])),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                "gauge",
                float(parts[21]) * page,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                "gauge",
                float(parts[19]) / ticks + btime,
            ),
            (
                "process_cpu_seconds_total",
                "Total user and system CPU time spent in seconds.",
                "counter",
                (float(parts[11]) + float(parts[12])) / ticks,
            ),
        ):
            yield Family(name, help, kind, [(name, {}, value)])
        try:
            with open("/proc/self/limits", "rb") as limits:
                max_fds = next(float(line.split()[3]) for line in limits if line.startswith(b"Max open file"))
            open_fds = len(os.listdir("/proc/self/fd"))
        except (OSError, StopIteration):
            return
        yield Family(
            "process_open_fds",
            "Number of open file descriptors.",
            "gauge",
            [("process_open_fds", {}, open_fds)],
        )
        yield Family(
            "process_max_fds",
            "Maximum number of open file descriptors.",
            "gauge",
            [("process_max_fds", {}, max_fds)],
        )


class Registry:
    """The collectors a /metrics answer writes, in order: by default the process's own families
    (those of prometheus_client's default registry), then what the process registers."""

    def __init__(self, collectors: Sequence[Collector] | None = None) -> None:
        self.collectors: list[Collector] = (
            list(collectors) if collectors is not None else [_GC(), _Platform(), _Process()]
        )

    def register(self, collector: Collector) -> None:
        self.collectors.append(collector)

    def unregister(self, collector: Collector) -> None:
        self.collectors.remove(collector)

    def collect(self) -> Iterator[Family]:
        for collector in self.collectors:
            yield from collector.collect()

    def exposition(self) -> bytes:
        return "".join(family.text() for family in self.collect()).encode()

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The value of the sample `name` with exactly `labels`, or None (as prometheus_client's)."""
        wanted = labels or {}
        for family in self.collect():
            for sample_name, sample_labels, value in family.samples:
                if sample_name == name and sample_labels == wanted:
                    return value
        return None


REGISTRY = Registry()


class _Metric:
    """What Counter, Gauge and Histogram share: name, help, label names, one child per label values
    (or a single one without labels), registered where they are made."""

    type = ""

    def __init__(
        self, name: str, help: str, labelnames: Sequence[str] = (), registry: Registry | None = REGISTRY
    ) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()
        if not self.labelnames:
            self._children[()] = self._new_child()
        if registry is not None:
            registry.register(self)

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def collect(self) -> Iterator[Family]:
        raise NotImplementedError

    def labels(self, *values: object) -> _Child:
        key = tuple(str(v) for v in values)
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames) or not key:
                raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
            with self._lock:
                child = self._children.setdefault(key, self._new_child())
        return child

    def remove(self, *values: object) -> None:
        with self._lock:
            self._children.pop(tuple(str(v) for v in values), None)

    def _items(self) -> list[tuple[dict[str, str], _Child]]:
        with self._lock:
            return [(dict(zip(self.labelnames, key, strict=True)), c) for key, c in self._children.items()]

    def _created(self, base: str, items: list[tuple[dict[str, str], _Child]]) -> Iterator[Family]:
        if items:
            yield Family(
                f"{base}_created",
                self.help,
                "gauge",
                [(f"{base}_created", lab, c.created) for lab, c in items],
            )


class _Child:
    __slots__ = ("_lock", "created", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        with self._lock:
            self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class Counter(_Metric):
    def _new_child(self) -> _Child:
        return _Child()

    def inc(self, amount: float = 1.0) -> None:
        self._children[()].inc(amount)

    def collect(self) -> Iterator[Family]:
        base = self.name.removesuffix("_total")
        items = self._items()
        yield Family(
            f"{base}_total", self.help, "counter", [(f"{base}_total", lab, c.value) for lab, c in items]
        )
        yield from self._created(base, items)


class Gauge(_Metric):
    def _new_child(self) -> _Child:
        return _Child()

    def set(self, value: float) -> None:
        self._children[()].set(value)

    def inc(self, amount: float = 1.0) -> None:
        self._children[()].inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self._children[()].dec(amount)

    def collect(self) -> Iterator[Family]:
        yield Family(self.name, self.help, "gauge", [(self.name, lab, c.value) for lab, c in self._items()])


class _HistogramChild(_Child):
    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        super().__init__()
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative

    def observe(self, value: float) -> None:
        bounds = self.bounds
        i = 0
        while value > bounds[i]:  # the last bound is +Inf
            i += 1
        with self._lock:
            self.counts[i] += 1
            self.value += value


class Histogram(_Metric):
    def __init__(
        self,
        name: str,
        help: str,
        labelnames: Sequence[str] = (),
        buckets: Sequence[float] = DEFAULT_BUCKETS,
        registry: Registry | None = REGISTRY,
    ) -> None:
        self._bounds = (*sorted(float(b) for b in buckets if b != math.inf), math.inf)
        super().__init__(name, help, labelnames, registry)

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self._bounds)

    def labels(self, *values: object) -> _HistogramChild:
        child = super().labels(*values)
        assert isinstance(child, _HistogramChild)
        return child

    def observe(self, value: float) -> None:
        self.labels()  # raises for a labeled histogram, as prometheus_client does
        child = self._children[()]
        assert isinstance(child, _HistogramChild)
        child.observe(value)

    def collect(self) -> Iterator[Family]:
        items = self._items()
        family = Family(self.name, self.help, "histogram")
        for labels, child in items:
            assert isinstance(child, _HistogramChild)
            with child._lock:
                counts, total = list(child.counts), child.value
            cumulative = 0
            for bound, count in zip(self._bounds, counts, strict=True):
                cumulative += count
                family.samples.append((f"{self.name}_bucket", {**labels, "le": go_float(bound)}, cumulative))
            family.samples.append((f"{self.name}_count", labels, cumulative))
            family.samples.append((f"{self.name}_sum", labels, total))
        yield family
        yield from self._created(self.name, items)
