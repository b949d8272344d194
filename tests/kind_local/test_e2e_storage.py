"""The `quick` selection of Kubernetes' external-storage e2e suite against kubeloop in node-local
mode (three workers, a pool each), with the driver file deploy/kind/e2e-driver.yaml and the
WaitForFirstConsumer class `kubeloop-wffc` for the dynamic specs (`--storage-class`, as
csi-driver-host-path's distributed test driver names its WaitForFirstConsumer class): each spec
places its pods on a node of its choosing, and an Immediate claim would be made on an elected node
instead. Topology (a volume reachable from one node), capacity (CSIStorageCapacity per node), data,
block mode, clones, the restore from a snapshot (on whichever node the scheduler puts its pod: that
node pulls the snapshot from the one that holds it, docs/transfer.md) and expansion. `make
e2e-storage E2E_MODE=node-local` runs the whole suite."""

from __future__ import annotations

from pathlib import Path

from ..kind.conftest import KindCluster
from ..kind.e2e_quick import assert_quick_specs_pass


def test_quick_external_storage_specs_pass_in_node_local_mode(
    local_cluster: KindCluster, tmp_path: Path
) -> None:
    assert_quick_specs_pass(local_cluster.cluster, tmp_path)
