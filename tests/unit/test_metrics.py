"""controller_runtime.metrics against prometheus_client, which kubeloop's processes served before
(issue 49): the same text for every kind of metric they use, the default families, the lookup
tests use, and no process importing prometheus_client or aiohttp any more."""

from __future__ import annotations

import re
import threading

import prometheus_client as pc
import pytest
from prometheus_client.core import CounterMetricFamily as PcCounterFamily
from prometheus_client.core import GaugeMetricFamily as PcGaugeFamily
from prometheus_client.core import HistogramMetricFamily as PcHistogramFamily
from prometheus_client.core import Metric as PcMetric

from controller_runtime import csi_common
from controller_runtime import metrics as ours
from tests.support.imports import imported_packages


def _without_created(text: str) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", text)


def _both() -> tuple[ours.Registry, pc.CollectorRegistry]:
    return ours.Registry([]), pc.CollectorRegistry()


def test_counters_gauges_and_histograms_read_as_prometheus_clients() -> None:
    mine, theirs = _both()
    made = []
    for lib, registry in ((ours, mine), (pc, theirs)):
        made.append(
            (
                lib.Counter("a_total", "labeled counter", ["x", "y"], registry=registry),
                lib.Counter("plain", "a counter named without _total", registry=registry),
                lib.Counter("unused_total", "never incremented", ["x"], registry=registry),
                lib.Gauge("g", "labeled gauge", ["y"], registry=registry),
                lib.Gauge("g_plain", "gauge with help\nand a \\ backslash", registry=registry),
                lib.Histogram("h_seconds", "default buckets", registry=registry),
                lib.Histogram(
                    "h_labeled", "own buckets", ["z"], buckets=(0.1, 1, 2.5, 300), registry=registry
                ),
            )
        )
    for counter, plain, _unused, gauge, gauge_plain, hist, labeled in made:
        counter.labels("1", 'q"\\\n').inc(2)
        counter.labels("2", "b").inc()
        plain.inc(0.5)
        gauge.labels("a").set(3.25)
        gauge.labels("b").inc(4)
        gauge.labels("b").dec(1.5)
        gauge_plain.set(1.79e9)
        for value in (0.001, 0.1, 7, 11):
            hist.observe(value)
        for value in (0.1, 1.0000001, 400):
            labeled.labels("w").observe(value)
        gauge.labels("gone").set(1)
        gauge.remove("gone")
    expected = _without_created(pc.generate_latest(theirs).decode())
    assert _without_created(mine.exposition().decode()) == expected


def test_families_made_at_scrape_time_read_as_prometheus_clients() -> None:
    class Mine:
        def collect(self) -> list[ours.Family]:
            g = ours.GaugeMetricFamily("cg", "custom gauge", labels=["l"])
            g.add_metric(["v"], 1)
            c = ours.CounterMetricFamily("cc", "custom counter", labels=["l"])
            c.add_metric(["v"], 2)
            h = ours.HistogramMetricFamily("ch", "custom histogram", labels=["l"])
            h.add_metric(["v"], [("1", 1), ("+Inf", 2)], 3.5)
            u = ours.UntypedMetricFamily("un", "no type")
            u.add_sample("un", {"a": "b"}, 4)
            return [
                g,
                ours.GaugeMetricFamily("cg2", "one value", value=7),
                c,
                ours.CounterMetricFamily("n", "v", value=2),
                h,
                u,
            ]

    class Theirs:
        def collect(self) -> list[PcMetric]:
            g = PcGaugeFamily("cg", "custom gauge", labels=["l"])
            g.add_metric(["v"], 1)
            c = PcCounterFamily("cc", "custom counter", labels=["l"])
            c.add_metric(["v"], 2)
            h = PcHistogramFamily("ch", "custom histogram", labels=["l"])
            h.add_metric(["v"], [("1", 1), ("+Inf", 2)], 3.5)
            u = PcMetric("un", "no type", "unknown")
            u.add_sample("un", {"a": "b"}, 4)
            return [
                g,
                PcGaugeFamily("cg2", "one value", value=7),
                c,
                PcCounterFamily("n", "v", value=2),
                h,
                u,
            ]

    mine, theirs = _both()
    mine.register(Mine())
    theirs.register(Theirs())
    assert mine.exposition().decode() == pc.generate_latest(theirs).decode()


def test_the_default_families_are_prometheus_clients_default_ones() -> None:
    def heads(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#")]

    theirs = pc.CollectorRegistry()  # what prometheus_client's default registry starts with
    pc.GCCollector(theirs)
    pc.PlatformCollector(theirs)
    pc.ProcessCollector(registry=theirs)
    text = ours.Registry().exposition().decode()
    expected = pc.generate_latest(theirs).decode()
    assert heads(text) == heads(expected)
    names = [line.split("{")[0].split(" ")[0] for line in text.splitlines()]
    assert names == [line.split("{")[0].split(" ")[0] for line in expected.splitlines()]
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    info = re.search(r"^python_info\{.*$", text, re.M)
    assert info is not None and samples[info.group(0).rsplit(" ", 1)[0]] == "1.0"
    assert float(samples["process_resident_memory_bytes"]) > 1e6
    assert float(samples["process_open_fds"]) >= 3


def test_the_csi_operations_histogram_is_the_upstream_sidecars_family() -> None:
    registry = ours.Registry([csi_common.OPERATIONS])
    text = registry.exposition().decode()
    assert text.startswith(
        "# HELP csi_sidecar_operations_seconds CSI operation latency by method and gRPC code\n"
        "# TYPE csi_sidecar_operations_seconds histogram\n"
    )


def test_sample_lookup_wrong_labels_and_threads() -> None:
    registry = ours.Registry([])
    counter = ours.Counter("n_total", "n", ["k"], registry=registry)
    hist = ours.Histogram("d", "d", registry=registry)
    with pytest.raises(ValueError, match="takes labels"):
        counter.labels("a", "b")
    with pytest.raises(ValueError, match="takes labels"):
        ours.Histogram("l", "l", ["k"], registry=registry).observe(1)

    def work() -> None:
        for _ in range(10_000):
            counter.labels("a").inc()
            hist.observe(0.2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.get_sample_value("n_total", {"k": "a"}) == 40_000
    assert registry.get_sample_value("d_count") == 40_000
    assert registry.get_sample_value("d_bucket", {"le": "0.25"}) == 40_000
    assert registry.get_sample_value("n_total", {"k": "b"}) is None


@pytest.mark.parametrize(
    "module",
    [
        "csi_driver.main",
        "external_provisioner.main",
        "external_resizer.main",
        "external_attacher.main",
        "services.pv_controller.main",
        "services.attach_detach.main",
        "services.node_agent.main",
    ],
)
def test_no_process_imports_prometheus_client_or_aiohttp(module: str) -> None:
    found = imported_packages(module, ("prometheus_client", "aiohttp", "yarl", "multidict"))
    assert found == [], f"{module} imports {found}"
