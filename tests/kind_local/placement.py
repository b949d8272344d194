"""Where a node-local volume lives in the kind cluster of tests/kind_local: each worker's own pool
directory on the host, and the nodes a PV's node affinity pins it to."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..kind.conftest import KindCluster
from ..kind.workloads import attachments, volume_of

TOPOLOGY_KEY = "topology.loop.csi.kubeloop.dev/node"
WFFC = "kubeloop-wffc"


def pools(kc: KindCluster) -> dict[str, Path]:
    return {node: kc.cluster.pool_dir(node) for node in kc.workers()}


def pinned_nodes(pv: dict[str, Any]) -> list[str]:
    terms = pv["spec"]["nodeAffinity"]["required"]["nodeSelectorTerms"]
    return [v for t in terms for e in t["matchExpressions"] if e["key"] == TOPOLOGY_KEY for v in e["values"]]


def backing_files(kc: KindCluster, handle: str) -> dict[str, bool]:
    """Whether each worker's own host directory holds the volume's backing file."""
    return {node: (pool / "volumes" / f"{handle}.img").exists() for node, pool in pools(kc).items()}


def node_of(kc: KindCluster, ns: str, pod_name: str) -> str:
    node: str = kc.get("pod", "-n", ns, pod_name)["spec"]["nodeName"]
    return node


def assert_lives_on(kc: KindCluster, ns: str, claim_name: str, node: str) -> dict[str, Any]:
    """The claim's volume is pinned to `node` only, its backing file is in that node's pool only, and
    nothing was attached."""
    pv = volume_of(kc, ns, claim_name)
    assert pinned_nodes(pv) == [node], pv["spec"]["nodeAffinity"]
    handle = pv["spec"]["csi"]["volumeHandle"]
    assert backing_files(kc, handle) == {n: n == node for n in kc.workers()}
    assert attachments(kc, pv["metadata"]["name"]) == []
    return pv


def delete_and_wait(kc: KindCluster, ns: str, *objects: str) -> None:
    kc.kubectl("delete", "-n", ns, *objects, "--wait=true", "--timeout=120s", timeout=150)
