"""The `quick` selection of Kubernetes' external-storage e2e suite against kubeloop in node-local
mode (three workers, a pool each), with the driver file deploy/kind/e2e-driver.yaml: topology (a
volume reachable from one node), capacity (CSIStorageCapacity per node), data, block mode and
expansion. Left out: the two data-source specs (a clone, a restore from a snapshot). Their claims
bind Immediately, so the node that takes one is elected, not the source's; the driver answers such
a node NOT_FOUND ("node-local volumes are cloned and restored on the node that holds the source"),
which the external-provisioner treats as final, and the claim never binds (each spec then waits out
its 15-minute timeout). tests/kind_local/test_node_local.py covers restores and clones on the
source's node. `make e2e-storage E2E_MODE=node-local` runs the whole suite."""

from __future__ import annotations

from pathlib import Path

from ..kind.conftest import KindCluster
from ..kind.e2e_quick import assert_quick_specs_pass


def test_quick_external_storage_specs_pass_in_node_local_mode(
    local_cluster: KindCluster, tmp_path: Path
) -> None:
    assert_quick_specs_pass(local_cluster.cluster, tmp_path)
