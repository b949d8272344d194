"""The pure parts of bench/scaling.py and bench/memory.py: points, the common record of the three
benchmarks, the memory figures derived from RSS readings and the idle test; and bench/common's
peak-RSS sampler on this process."""

from __future__ import annotations

import asyncio
import math
import os

import pytest

from bench import attach, binding, memory, provisioning, scaling
from bench.common import CpuUse, PeakRss, percentile
from controller_runtime.clock_testing import FakeClock
from localstack.components import Component


def test_points_parse_in_order() -> None:
    assert scaling.parse_points("binding:100, attach:500,provisioning:1000") == [
        scaling.Point("binding", 100),
        scaling.Point("attach", 500),
        scaling.Point("provisioning", 1000),
    ]
    assert len(scaling.parse_points(scaling.DEFAULT_POINTS)) == 9


@pytest.mark.parametrize("text", ["", "binding", "binding:", "binding:0", "expansion:100", "attach:1e3"])
def test_points_reject_what_is_not_a_point(text: str) -> None:
    with pytest.raises(ValueError):
        scaling.parse_points(text)


def test_point_labels_name_the_load() -> None:
    assert scaling.Point("binding", 5000).label == "binding 5,000 pairs (unthrottled)"
    assert scaling.Point("attach", 100).label == "attach 100 pods (QPS 50/100)"


def test_binding_and_provisioning_map_to_common_terms() -> None:
    run = binding.Run(
        "unthrottled", "go", 100, 5000.0, 10000, 4.0, 25.0, 2.0, 3.9, 20.0, 30.0, 5.0, 78.5, False
    )
    got = scaling.from_binding(run, 12.34)
    assert (got.size, got.throughput_per_s, got.latency_p50_s, got.latency_p99_s) == (100, 25.0, 2.0, 3.9)
    assert (got.peak_rss_mib, got.wall_s, got.source["side"]) == (78.5, 12.3, "go")
    prov = provisioning.Run(
        "unthrottled", "kubeloop", 100, 1000.0, 2000, 100, 3.0, 33.3, 1.2, 2.9, 0, 98.0, 1.5, 1.2
    )
    got = scaling.from_provisioning(prov, 20.0)
    assert (got.throughput_per_s, got.latency_p99_s) == (33.3, 2.9)
    assert got.peak_rss_by_process == {"provisioner": 98.0}


def test_attach_sums_the_sides_controllers_and_rates_pods_over_the_mount_pass() -> None:
    peaks = {"external-attacher": 60.0, "attach-detach-controller": 70.5}
    run = attach.Pass(100, 0.1, 0.3, 0.5, 1.5, 4.0, 5.0, 0.6, 0.8, 1.0, 2.0, 2.5, peaks)
    got = scaling.from_attach(run, 30.0, 120.04)
    assert got.throughput_per_s == 20.0
    assert (got.latency_p50_s, got.latency_p99_s) == (1.5, 4.0)
    assert got.peak_rss_mib == 130.5
    assert got.source["setup_s"] == 120.0
    empty = attach.Pass(1, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0)
    assert scaling.from_attach(empty, 1.0, 1.0).throughput_per_s == 0.0


def test_memory_share_is_against_the_empty_cluster_for_kubeloop_and_the_baseline_for_kcm() -> None:
    empty, full = memory.Reading(90.0, 91.0, 21.0), memory.Reading(130.0, 140.0, 25.0)
    kubeloop = memory.derive(10_000, empty, full, None)
    assert (kubeloop.share_mib, kubeloop.baseline_mib, kubeloop.growth_per_10k_mib) == (40.0, 90.0, 40.0)
    assert kubeloop.bytes_per_pv == round(40 * 2**20 / 10_000)
    kcm = memory.derive(5_000, memory.Reading(70.0, 70.0, 20.0), memory.Reading(100.0, 100.0, 20.0), 72.0)
    assert (kcm.share_mib, kcm.growth_per_10k_mib, kcm.rss_empty_mib) == (28.0, 60.0, 70.0)


def test_settled_needs_the_whole_window_and_a_steady_rss() -> None:
    steady = [(float(t), 100.0 + 0.05 * t) for t in range(12)]
    assert memory.settled(steady, 10.0, 0.01)
    assert not memory.settled(steady[:5], 10.0, 0.01)  # not a window's worth yet
    assert not memory.settled([*steady, (12.0, 110.0)], 10.0, 0.01)  # still growing
    assert not memory.settled([], 10.0, 0.01)


def test_peak_rss_follows_named_processes_and_skips_gone_ones() -> None:
    async def sample() -> dict[str, float]:
        clock = FakeClock()
        pids = {"self": os.getpid(), "none": None, "gone": 2**22 + 1}
        async with PeakRss(lambda: pids, 0.01, clock) as rss:
            await clock.advance(0.05)  # a sample every 0.01 s of the clock
        return rss.peaks

    peaks = asyncio.run(sample())
    assert set(peaks) == {"self"} and peaks["self"] > 1


def test_isolating_puts_one_kubeloop_controller_beside_the_other_go_one() -> None:
    def comp(name: str) -> Component:
        return Component(name=name, argv=lambda _c: [name])

    kubeloop = [comp("external-attacher"), comp("attach-detach-controller")]
    go = [comp("go-csi-attacher"), comp("go-kcm-attachdetach")]
    adc = attach.isolating(kubeloop, go, "attach-detach-controller")
    assert [c.name for c in adc] == ["go-csi-attacher", "attach-detach-controller"]
    assert adc[1] is kubeloop[1]
    att = attach.isolating(kubeloop, go, "external-attacher")
    assert [c.name for c in att] == ["external-attacher", "go-kcm-attachdetach"]
    # Every scenario but the default, the pre-attached and the creation one names a controller
    # with a Go counterpart.
    assert set(attach.SCENARIOS) - {"default", attach.PRE_ATTACHED, attach.CREATION} == set(
        attach.GO_COUNTERPART
    )


def test_the_flags_choose_the_scenarios_in_one_order() -> None:
    names = attach.scenario_names
    assert names(isolate=False, floor=False, creation=False) == ["default"]
    assert names(isolate=False, floor=True, creation=False) == ["default", attach.PRE_ATTACHED]
    assert names(isolate=False, floor=False, creation=True) == ["default", attach.CREATION]
    assert names(isolate=True, floor=True, creation=True) == list(attach.SCENARIOS)
    assert names(isolate=True, floor=False, creation=False)[-1] == "external-attacher"


def test_a_partial_pass_leaves_what_it_did_not_measure_unset() -> None:
    p = attach.Pass.partial(100, va_created_p50_s=0.2, va_created_p99_s=0.3)
    assert (p.pods, p.va_created_p50_s, p.va_created_p99_s) == (100, 0.2, 0.3)
    assert math.isnan(p.mount_p50_s) and math.isnan(p.detach_total_s) and math.isnan(p.pod_seen_p99_s)
    assert p.api_requests == {} and p.cpu_s == {}


def test_a_pass_counts_every_process_cpu_per_pod() -> None:
    cpu = CpuUse(dict)
    cpu.spent = {"kube-apiserver": 1.3, "node-agent-node-a": 0.4, "external-attacher": 0.25}
    assert attach.per_pod_ms(cpu, 100) == 19.5


def test_percentiles_are_nearest_rank() -> None:
    hundred = [float(v) for v in range(100, 0, -1)]
    assert percentile(hundred, 50) == 50.0
    assert percentile(hundred, 99) == 99.0  # the 99th of 100, not the largest
    assert percentile(hundred, 100) == 100.0
    assert percentile(hundred, 0) == 1.0
    assert percentile([float(v) for v in range(1, 501)], 99) == 495.0
    assert percentile([float(v) for v in range(1, 1001)], 99) == 990.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([7.0], 99) == 7.0
