"""The `quick` selection of Kubernetes' external-storage e2e suite against kubeloop in node-local
mode (three workers, a pool each): the same specs as tests/kind/test_e2e_storage.py, among them
topology (a volume reachable from one node) and capacity (CSIStorageCapacity per node), with the
driver file deploy/kind/e2e-driver.yaml. `make e2e-storage E2E_MODE=node-local` runs the whole suite."""

from __future__ import annotations

from pathlib import Path

from ..kind.conftest import KindCluster
from ..kind.e2e_quick import assert_quick_specs_pass


def test_quick_external_storage_specs_pass_in_node_local_mode(
    local_cluster: KindCluster, tmp_path: Path
) -> None:
    assert_quick_specs_pass(local_cluster.cluster, tmp_path)
