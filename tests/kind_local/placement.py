"""Where a node-local volume lives in the kind cluster of tests/kind_local: each worker's own pool
directory on the host, and the nodes a PV's node affinity pins it to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..kind.conftest import KindCluster

TOPOLOGY_KEY = "topology.loop.csi.kubeloop.dev/node"


def pools(kc: KindCluster) -> dict[str, Path]:
    return {node: kc.cluster.pool_dir(node) for node in kc.workers()}


def pinned_nodes(pv: dict[str, Any]) -> list[str]:
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    return [v for t in terms for e in t["matchExpressions"] if e["key"] == TOPOLOGY_KEY for v in e["values"]]
