"""The node agent's kubelet_volume_stats_* beside a real kubelet's: in kind, the real kubelet asks
kubeloop's node plugin for a claim's usage and serves it on /metrics; the families it serves have
the names, help texts, types and labels the node agent's collector gives the local stack and
compose, and count the data the pod wrote."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from controller_runtime.metrics import Registry
from services.node_agent.volume_stats import ClaimRef, VolumeStats, VolumeStatsCollector
from tests.support.waits import eventually

from .conftest import KindCluster
from .workloads import WRITE, claim, pod, wait_ready

pytestmark = pytest.mark.root
PREFIX = "kubelet_volume_stats_"


def families(text: str) -> dict[str, tuple[str, str, list[tuple[dict[str, str], float]]]]:
    """kubelet_volume_stats_* families: name -> (help, type, [(labels, value)])."""
    return {
        f.name: (f.documentation, f.type, [(s.labels, s.value) for s in f.samples])
        for f in text_string_to_metric_families(text)
        if f.name.startswith(PREFIX)
    }


def test_the_real_kubelets_volume_metrics_are_the_node_agents(
    kind_cluster: KindCluster, namespace: str
) -> None:
    kc, ns = kind_cluster, namespace
    node = kc.workers()[0]
    kc.apply(claim(ns, "data") + "---" + pod(ns, "writer", "data", node, WRITE))
    wait_ready(kc, ns, "writer")
    mine = {"namespace": ns, "persistentvolumeclaim": "data"}

    def kubelets() -> dict[str, tuple[str, str, list[tuple[dict[str, str], float]]]] | None:
        text = kc.kubectl("get", "--raw", f"/api/v1/nodes/{node}/proxy/metrics")
        found = families(text)
        used = [v for labels, v in found.get(PREFIX + "used_bytes", ("", "", []))[2] if labels == mine]
        return found if used and used[0] >= 4 << 20 else None

    real = eventually("kubelet to report the 4 MiB the pod wrote", kubelets, 90, 2)
    registry = Registry([])
    collector = VolumeStatsCollector()
    collector.replace({ClaimRef(ns, "data"): VolumeStats(1, 1, 1, 1, 1, 1, abnormal=False)})
    registry.register(collector)
    ours = families(registry.exposition().decode())
    # Every family kubelet served is ours, alike in help, type and labels; kubelet serves the health
    # gauge only with its CSIVolumeHealth feature gate on.
    assert set(real) <= set(ours) and len(real) >= 6, sorted(real)
    for name, (help_text, kind, samples) in real.items():
        assert (help_text, kind) == ours[name][:2], name
        assert {frozenset(labels) for labels, _ in samples} == {frozenset(mine)}, name
    capacity = next(v for labels, v in real[PREFIX + "capacity_bytes"][2] if labels == mine)
    assert 50 << 20 < capacity <= 64 << 20
