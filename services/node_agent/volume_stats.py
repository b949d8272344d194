"""kubelet's volume metrics, from the node plugin's NodeGetVolumeStats.

kubelet asks every CSI volume of its pods for its usage each `--volume-stats-agg-period` (1m by
default) and serves the last answers per claim on `/metrics`, which the usual disk-full alerts and
dashboards read: `kubelet_volume_stats_{capacity,available,used}_bytes`,
`kubelet_volume_stats_inodes{,_free,_used}` and, when the driver reports a volume condition,
`kubelet_volume_stats_health_status_abnormal`, all labelled `namespace` and
`persistentvolumeclaim`. The node agent does the same, with kubelet's names, labels, help texts and
rules: a claim used by several pods is reported once; a unit the driver leaves out is 0 (a block
volume has a capacity only); an inline volume has no claim and no series.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from controller_runtime.logs import get_logger
from controller_runtime.metrics import GaugeMetricFamily
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

log = get_logger("node-agent")

LABELS = ("namespace", "persistentvolumeclaim")
# (name, kubelet's help text); component-base prefixes the stability level, as here.
CAPACITY = ("kubelet_volume_stats_capacity_bytes", "Capacity in bytes of the volume")
AVAILABLE = ("kubelet_volume_stats_available_bytes", "Number of available bytes in the volume")
USED = ("kubelet_volume_stats_used_bytes", "Number of used bytes in the volume")
INODES = ("kubelet_volume_stats_inodes", "Maximum number of inodes in the volume")
INODES_FREE = ("kubelet_volume_stats_inodes_free", "Number of free inodes in the volume")
INODES_USED = ("kubelet_volume_stats_inodes_used", "Number of used inodes in the volume")
ABNORMAL = (
    "kubelet_volume_stats_health_status_abnormal",
    "Abnormal volume health status. The count is either 1 or 0. 1 indicates the volume is unhealthy, "
    "0 indicates volume is healthy",
)


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    name: str


@dataclass(frozen=True)
class VolumeStats:
    capacity_bytes: int = 0
    available_bytes: int = 0
    used_bytes: int = 0
    inodes: int = 0
    inodes_free: int = 0
    inodes_used: int = 0
    abnormal: bool | None = None  # None: the driver reported no condition


@dataclass(frozen=True)
class StatsTarget:
    """One claim's volume as a pod of this node has it published: what NodeGetVolumeStats is asked."""

    claim: ClaimRef
    driver: str
    handle: str
    volume_path: str
    staging_path: str


def stats_of(resp: csi_pb2.NodeGetVolumeStatsResponse) -> VolumeStats:
    """kubelet's reading of an answer: BYTES gives the byte figures, INODES the inode ones, a unit
    left out is 0, and a condition is abnormal or not."""
    figures: dict[str, int] = {}
    for usage in resp.usage:
        if usage.unit == csi_pb2.VolumeUsage.BYTES:
            figures.update(capacity_bytes=usage.total, available_bytes=usage.available, used_bytes=usage.used)
        elif usage.unit == csi_pb2.VolumeUsage.INODES:
            figures.update(inodes=usage.total, inodes_free=usage.available, inodes_used=usage.used)
    abnormal = resp.volume_condition.abnormal if resp.HasField("volume_condition") else None
    return VolumeStats(**figures, abnormal=abnormal)


class VolumeStatsCollector:
    """The last answers, per claim, as kubelet's gauges; replaced whole by each collection round."""

    def __init__(self) -> None:
        self._stats: dict[ClaimRef, VolumeStats] = {}

    def replace(self, stats: Mapping[ClaimRef, VolumeStats]) -> None:
        self._stats = dict(stats)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self._stats
        fields = (
            (CAPACITY, "capacity_bytes"),
            (AVAILABLE, "available_bytes"),
            (USED, "used_bytes"),
            (INODES, "inodes"),
            (INODES_FREE, "inodes_free"),
            (INODES_USED, "inodes_used"),
        )
        for (name, text), attr in fields:
            family = GaugeMetricFamily(name, f"[ALPHA] {text}", labels=LABELS)
            for ref, s in stats.items():
                family.add_metric([ref.namespace, ref.name], float(getattr(s, attr)))
            yield family
        health = GaugeMetricFamily(ABNORMAL[0], f"[ALPHA] {ABNORMAL[1]}", labels=LABELS)
        for ref, s in stats.items():
            if s.abnormal is not None:
                health.add_metric([ref.namespace, ref.name], 1.0 if s.abnormal else 0.0)
        yield health


async def gather(
    targets: Iterable[StatsTarget], node_services: Mapping[str, csi_pb2_grpc.NodeStub], timeout: float
) -> dict[ClaimRef, VolumeStats]:
    """Asks each claim's volume once (the first pod's publish of it), all at once; a volume whose
    answer fails keeps no series this round, as kubelet drops a volume it cannot measure."""
    chosen: dict[ClaimRef, StatsTarget] = {}
    for t in targets:
        if t.driver in node_services:
            chosen.setdefault(t.claim, t)

    async def one(t: StatsTarget) -> VolumeStats | None:
        node = node_services[t.driver]
        try:
            resp = await node.NodeGetVolumeStats(
                csi_pb2.NodeGetVolumeStatsRequest(
                    volume_id=t.handle, volume_path=t.volume_path, staging_target_path=t.staging_path
                ),
                timeout=timeout,
            )
        except Exception as exc:  # any failure: no figures for it this round
            log.debug("volume stats failed", claim=f"{t.claim.namespace}/{t.claim.name}", error=str(exc))
            return None
        return stats_of(resp)

    answers = await asyncio.gather(*(one(t) for t in chosen.values()))
    return {ref: s for ref, s in zip(chosen, answers, strict=True) if s is not None}
