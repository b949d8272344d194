"""The node agent's reading of NodeGetVolumeStats as kubelet reads it, and the gauges it makes."""

from __future__ import annotations

from controller_runtime.metrics import Registry
from kubeloop_grpc.csi import csi_pb2
from services.node_agent.volume_stats import ClaimRef, VolumeStats, VolumeStatsCollector, stats_of

Unit = csi_pb2.VolumeUsage.Unit


def test_bytes_and_inodes_fill_their_figures_and_a_missing_unit_is_zero() -> None:
    both = csi_pb2.NodeGetVolumeStatsResponse(
        usage=[
            csi_pb2.VolumeUsage(total=100, available=60, used=40, unit=Unit.BYTES),
            csi_pb2.VolumeUsage(total=10, available=7, used=3, unit=Unit.INODES),
        ]
    )
    assert stats_of(both) == VolumeStats(100, 60, 40, 10, 7, 3, None)
    block = csi_pb2.NodeGetVolumeStatsResponse(usage=[csi_pb2.VolumeUsage(total=4096, unit=Unit.BYTES)])
    assert stats_of(block) == VolumeStats(capacity_bytes=4096)


def test_a_condition_becomes_the_health_gauge_and_no_condition_no_series() -> None:
    sick = csi_pb2.NodeGetVolumeStatsResponse(
        volume_condition=csi_pb2.VolumeCondition(abnormal=True, message="backing file is gone")
    )
    collector = VolumeStatsCollector()
    collector.replace({ClaimRef("ns", "sick"): stats_of(sick), ClaimRef("ns", "quiet"): VolumeStats()})
    registry = Registry([])
    registry.register(collector)
    text = registry.exposition().decode()
    health = [
        line for line in text.splitlines() if line.startswith("kubelet_volume_stats_health_status_abnormal{")
    ]
    assert health == [
        'kubelet_volume_stats_health_status_abnormal{namespace="ns",persistentvolumeclaim="sick"} 1.0'
    ]
    assert 'kubelet_volume_stats_capacity_bytes{namespace="ns",persistentvolumeclaim="quiet"} 0.0' in text
