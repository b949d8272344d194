"""The `quick` selection of Kubernetes' external-storage e2e suite against kubeloop in node-local
mode (three workers, a pool each), with the driver file deploy/kind/e2e-driver.yaml and the
WaitForFirstConsumer class `kubeloop-wffc` for the dynamic specs (`--storage-class`, as
csi-driver-host-path's distributed test driver names its WaitForFirstConsumer class): each spec
places its pods on a node of its choosing, and an Immediate claim would be made on an elected node
instead. Topology (a volume reachable from one node), capacity (CSIStorageCapacity per node), data,
block mode, clones and expansion. Left out: the restore from a snapshot. The spec lets the
scheduler place the restored claim's pod, which knows nothing of where the snapshot lives; a node
without it answers NOT_FOUND, and the claim is given back to the scheduler, whose scoring picks the
same node again (csi-driver-host-path's distributed test driver does not claim snapshotDataSource
either). tests/kind_local/test_node_local.py restores on the source's node. `make e2e-storage
E2E_MODE=node-local` runs the whole suite."""

from __future__ import annotations

from pathlib import Path

from localstack.e2e_storage import QUICK_SPECS

from ..kind.conftest import KindCluster
from ..kind.e2e_quick import assert_quick_specs_pass

# Every quick spec but the restore, which a node-local pool can serve only on the snapshot's node.
NODE_LOCAL_SPECS = tuple(s for s in QUICK_SPECS if "snapshot data source" not in s)


def test_quick_external_storage_specs_pass_in_node_local_mode(
    local_cluster: KindCluster, tmp_path: Path
) -> None:
    assert_quick_specs_pass(local_cluster.cluster, tmp_path, NODE_LOCAL_SPECS)
