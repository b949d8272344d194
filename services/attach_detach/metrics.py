"""The attach-detach controller's metrics with kcm's names: total volumes per plugin and world,
computed at scrape time, and the forced-detach counter. Beside them, kubeloop's own pair about
VolumeAttachments being deleted (their count and the oldest one's age), which kcm has no metric
for and an alert on a detach that never finishes needs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from controller_runtime.metrics import REGISTRY, Family, GaugeMetricFamily
from controller_runtime.volumes import CSI_PLUGIN_NAME

Counts = Callable[[], tuple[int, int]]  # (desired, actual)
Deletions = Callable[[], list[str]]  # the deletionTimestamps of the VolumeAttachments being deleted
DELETING = "kubeloop_volumeattachments_deleting"
DELETING_OLDEST = "kubeloop_volumeattachment_deleting_oldest_seconds"
FORCED_DETACHES = "attach_detach_controller_attachdetach_controller_forced_detaches"


@dataclass(eq=False)  # registered in a dict: hashed by identity
class _Collector:
    sources: list[Counts] = field(default_factory=list)
    deletions: list[Deletions] = field(default_factory=list)
    # reason ("timeout" or "out-of-service") -> count
    forced_detaches: dict[str, int] = field(default_factory=dict)

    def record_forced_detach(self, reason: str) -> None:
        self.forced_detaches[reason] = self.forced_detaches.get(reason, 0) + 1

    def collect(self) -> Iterator[Family]:
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
        # kcm registers this counter with subsystem attach_detach_controller in front of its name and
        # without a _total suffix: a Family as it is (CounterMetricFamily would add one).
        help_text = "Number of times the A/D Controller performed a forced detach"
        forced = Family(FORCED_DETACHES, help_text, "counter")
        for reason, count in sorted(self.forced_detaches.items()):
            forced.samples.append((FORCED_DETACHES, {"reason": reason}, float(count)))
        yield forced
        stamps = [stamp for source in self.deletions for stamp in source()]
        now = dt.datetime.now(dt.UTC)
        ages = [(now - dt.datetime.fromisoformat(t.replace("Z", "+00:00"))).total_seconds() for t in stamps]
        yield GaugeMetricFamily(DELETING, "VolumeAttachments with a deletionTimestamp", value=len(ages))
        yield GaugeMetricFamily(
            DELETING_OLDEST,
            "Seconds since the oldest VolumeAttachment being deleted was asked to go (0 when none is)",
            value=max(ages, default=0.0),
        )


METRICS = _Collector()
REGISTRY.register(METRICS)
