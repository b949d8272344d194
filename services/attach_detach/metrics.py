"""The attach-detach controller's metrics with kcm's names: total volumes per plugin and world,
computed at scrape time, and the forced-detach counter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller_runtime.volumes import CSI_PLUGIN_NAME

Counts = Callable[[], tuple[int, int]]  # (desired, actual)


@dataclass(eq=False)  # registered in a dict: hashed by identity
class _Collector(Collector):
    sources: list[Counts] = field(default_factory=list)
    forced_detaches: int = 0

    def collect(self) -> Iterator[Metric]:
        total = GaugeMetricFamily(
            "attachdetach_controller_total_volumes",
            "Number of volumes in A/D Controller",
            labels=["plugin_name", "state"],
        )
        desired = actual = 0
        for source in self.sources:
            d, a = source()
            desired, actual = desired + d, actual + a
        total.add_metric([CSI_PLUGIN_NAME, "desired_state_of_world"], desired)
        total.add_metric([CSI_PLUGIN_NAME, "actual_state_of_world"], actual)
        yield total
        # kcm exposes this counter without a _total suffix; prometheus_client would add one to
        # any counter, so it goes out untyped under the upstream name that dashboards query.
        forced = Metric(
            "attachdetach_controller_forced_detaches",
            "Number of times the A/D Controller performed a forced detach",
            "unknown",
        )
        forced.add_sample("attachdetach_controller_forced_detaches", {}, float(self.forced_detaches))
        yield forced


METRICS = _Collector()
REGISTRY.register(METRICS)
