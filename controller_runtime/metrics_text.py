"""Prometheus metrics without prometheus_client, for the processes that serve one histogram and the
process metrics (node-driver-registrar, livenessprobe): prometheus_client costs them 4.8 MiB of RSS,
3 of it the standard library's urllib.request, email and http.server (issue 49).

It writes the text format as prometheus_client's `generate_latest` does, line for line, so scrapes,
dashboards and alerts see the same families: HELP and TYPE, labels sorted by name, values as Go
prints floats, a histogram's `_created` as a gauge family after it, and the default registry's
`python_gc_*`, `python_info` and `process_*` families. Its histograms are labeled ones only."""

from __future__ import annotations

import gc
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

# prometheus_client's CONTENT_TYPE_LATEST.
CONTENT_TYPE = "text/plain; version=1.0.0; charset=utf-8"

Collector = Callable[[], Iterable[str]]
"""Yields a family's lines, each ending in a newline."""


@dataclass(frozen=True)
class HistogramSpec:
    """A histogram's name, help, label names and buckets: what prometheus_client's Histogram and
    this module's are made from, so the two processes of either kind serve the same family."""

    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...]


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


def sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{key}="{_escape(val)}"' for key, val in sorted(labels.items()))
    return f"{name}{{{text}}} {go_float(value)}\n" if text else f"{name} {go_float(value)}\n"


def header(name: str, help: str, kind: str) -> str:
    escaped = help.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


@dataclass
class _Child:
    counts: list[int]  # per bucket, not cumulative
    total: float
    created: float


class Histogram:
    def __init__(self, spec: HistogramSpec) -> None:
        self.spec = spec
        self._bounds = (*sorted(spec.buckets), math.inf)
        self._children: dict[tuple[str, ...], _Child] = {}
        self._lock = threading.Lock()

    def observe(self, labels: Sequence[str], value: float) -> None:
        key = tuple(labels)
        if len(key) != len(self.spec.labels):
            raise ValueError(f"{self.spec.name} takes labels {self.spec.labels}, got {key}")
        with self._lock:
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = _Child([0] * len(self._bounds), 0.0, time.time())
            child.counts[next(i for i, bound in enumerate(self._bounds) if value <= bound)] += 1
            child.total += value

    def collect(self) -> Iterable[str]:
        name = self.spec.name
        with self._lock:
            children = [
                (key, _Child(list(c.counts), c.total, c.created)) for key, c in self._children.items()
            ]
        yield header(name, self.spec.help, "histogram")
        for key, child in children:
            labels = dict(zip(self.spec.labels, key, strict=True))
            cumulative = 0
            for bound, count in zip(self._bounds, child.counts, strict=True):
                cumulative += count
                yield sample(f"{name}_bucket", {**labels, "le": go_float(bound)}, cumulative)
            yield sample(f"{name}_count", labels, cumulative)
            yield sample(f"{name}_sum", labels, child.total)
        if children:
            yield header(f"{name}_created", self.spec.help, "gauge")
            for key, child in children:
                yield sample(f"{name}_created", dict(zip(self.spec.labels, key, strict=True)), child.created)


def gc_families() -> Iterable[str]:
    """prometheus_client's GCCollector."""
    stats = gc.get_stats()
    for stat, name, help in (
        ("collected", "python_gc_objects_collected_total", "Objects collected during gc"),
        ("uncollectable", "python_gc_objects_uncollectable_total", "Uncollectable objects found during GC"),
        ("collections", "python_gc_collections_total", "Number of times this generation was collected"),
    ):
        yield header(name, help, "counter")
        for generation, values in enumerate(stats):
            yield sample(name, {"generation": str(generation)}, values[stat])


def python_info() -> Iterable[str]:
    """prometheus_client's PlatformCollector on CPython (without importing `platform`)."""
    major, minor, micro = (str(part) for part in sys.version_info[:3])
    yield header("python_info", "Python platform information", "gauge")
    implementation = {"cpython": "CPython", "pypy": "PyPy"}.get(
        sys.implementation.name, sys.implementation.name
    )
    labels = {"implementation": implementation, "major": major, "minor": minor, "patchlevel": micro}
    yield sample("python_info", {**labels, "version": sys.version.split()[0]}, 1)


def _boot_time() -> float:
    with open("/proc/stat", "rb") as stat:
        for line in stat:
            if line.startswith(b"btime "):
                return float(line.split()[1])
    return 0.0


def process_families() -> Iterable[str]:
    """prometheus_client's ProcessCollector, from /proc/self as it reads it."""
    try:
        btime, ticks, page = _boot_time(), os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        with open("/proc/self/stat", "rb") as f:
            parts = f.read().split(b")")[-1].split()
    except OSError:
        return
    for name, help, kind, value in (
        ("process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge", float(parts[20])),
        ("process_resident_memory_bytes", "Resident memory size in bytes.", "gauge", float(parts[21]) * page),
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
        yield header(name, help, kind) + sample(name, {}, value)
    try:
        with open("/proc/self/limits", "rb") as limits:
            max_fds = next(float(line.split()[3]) for line in limits if line.startswith(b"Max open file"))
        open_fds = len(os.listdir("/proc/self/fd"))
    except (OSError, StopIteration):
        return
    yield header("process_open_fds", "Number of open file descriptors.", "gauge") + sample(
        "process_open_fds", {}, open_fds
    )
    yield header("process_max_fds", "Maximum number of open file descriptors.", "gauge") + sample(
        "process_max_fds", {}, max_fds
    )


class Registry:
    """The collectors a /metrics answer writes, in order: by default those of prometheus_client's
    default registry, then what the process adds."""

    def __init__(
        self, collectors: Sequence[Collector] = (gc_families, python_info, process_families)
    ) -> None:
        self.collectors = list(collectors)

    def register(self, collector: Collector) -> None:
        self.collectors.append(collector)

    def exposition(self) -> bytes:
        return "".join(line for collector in self.collectors for line in collector()).encode()


REGISTRY = Registry()
