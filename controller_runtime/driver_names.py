"""kubeloop's CSI driver's names, the contract between the driver and every process that deploys,
registers or finalizes for it: the driver imports them from here like the rest (a process package
imports no other)."""

from __future__ import annotations

DRIVER_NAME = "loop.csi.kubeloop.dev"
# The topology key's prefix: kubeloop's own domain. kubelet sets the node label of a driver's key
# itself, and the NodeRestriction admission plugin lets it set no label under kubernetes.io or
# k8s.io but a few of its own (hostpath's key, topology.hostpath.csi/node, avoids them the same way).
TOPOLOGY_PREFIX = "topology.loop.csi.kubeloop.dev"
TOPOLOGY_KEY = f"{TOPOLOGY_PREFIX}/node"


def topology_key(driver: str) -> str:
    """The node label a driver of this name reports as its one topology key: kubeloop's own key for
    kubeloop's name, and for the driver run under another name (--drivername) a key of that name in
    kubeloop's domain, so a node carrying it is one where that driver's plugin runs, which the
    scheduler and the e2e suite's topology specs read from the label alone. A CSI driver name is
    always a valid label name (at most 63 letters, digits, '-' and '.', alphanumeric at both ends)."""
    return TOPOLOGY_KEY if driver == DRIVER_NAME else f"{TOPOLOGY_PREFIX}/{driver}"
