"""A few minutes of Kubernetes' own external-storage e2e suite (e2e.test) against kubeloop in the kind
cluster of this package: the `quick` selection of localstack/e2e_storage.py, one spec of each thing
kubeloop does with a real kubelet (provisioning, data, block mode, clone, snapshot restore, offline
expansion, topology, capacity). `make e2e-storage` runs the whole suite (docs/e2e-storage.md)."""

from __future__ import annotations

from pathlib import Path

from .conftest import KindCluster
from .e2e_quick import assert_quick_specs_pass


def test_quick_external_storage_specs_pass(kind_cluster: KindCluster, tmp_path: Path) -> None:
    assert_quick_specs_pass(kind_cluster.cluster, tmp_path)
