"""Upstream's published RBAC for the Go CSI sidecars: the storage-csi manifests the Kubernetes e2e
suite ships (k8s.io/kubernetes@KUBERNETES_VERSION/test/e2e/testing-manifests/storage-csi/), read
from the Go module cache, which tools/build-binaries.sh fills."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from controller_runtime.toolchain import read_versions
from tests.upstream_flags import MissingUpstream, go_module_dir


@cache
def storage_csi() -> Path:
    version = read_versions()["KUBERNETES_VERSION"]
    try:
        root = go_module_dir("k8s.io/kubernetes", version)
    except MissingUpstream as exc:
        pytest.fail(
            f"{exc}\nupstream's rbac.yaml files come from the Go module cache: "
            f"`go mod download -json k8s.io/kubernetes@{version}` (tools/build-binaries.sh fills it)"
        )
    return root / "test" / "e2e" / "testing-manifests" / "storage-csi"
