"""kubeloop in a kind cluster: the names the node image, the manifests and tests/kind share."""

from __future__ import annotations

from controller_runtime.toolchain import read_versions

CLUSTER_NAME = "kubeloop"
BUSYBOX_IMAGE = "kubeloop/busybox:1.35.0"


def node_image() -> str:
    return f"kubeloop/kind-node:{read_versions()['KUBERNETES_VERSION']}"
