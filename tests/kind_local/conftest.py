"""kubeloop in node-local mode in a kind cluster of three workers whose pools are each their own
(`python -m localstack.kind up --pools separate`: nothing of kubeloop's is shared between nodes, and
the Helm chart installs it), created once for tests/kind_local and deleted right after them, the host
checked for leftovers as in tests/kind. KUBELOOP_KIND_KEEP=1 leaves the cluster running."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from localstack.kind import Cluster
from tests.kind.conftest import KindCluster, kind_session, scratch_namespace


@pytest.fixture(scope="package")
def local_cluster() -> Iterator[KindCluster]:
    with kind_session(Cluster(pools="separate", storage_controllers="cluster")) as kc:
        yield kc


@pytest.fixture
def namespace(local_cluster: KindCluster) -> Iterator[str]:
    with scratch_namespace(local_cluster) as name:
        yield name
