"""The node finalizer's counters, in the project's style (kubeloop_<component>_<what>_total)."""

from __future__ import annotations

from controller_runtime.metrics import Counter

NODES_FINALIZED = Counter(
    "kubeloop_node_finalizer_nodes_finalized_total",
    "Deleted Nodes whose finalizer was removed, by whether their volumes were cleaned up",
    ["cleanup"],  # done, skipped (--skip-node-finalize), shared-mode
)
VOLUMES_CLEANED = Counter(
    "kubeloop_node_finalizer_volumes_cleaned_total",
    "Writes cleaning up node-local volumes of deleted Nodes, by object and action",
    ["action"],  # claim-deleted, volume-deleted, volume-retained, claim-rescheduled
)
