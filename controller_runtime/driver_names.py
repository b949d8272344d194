"""kubeloop's CSI driver's names, the contract between the driver and every process that deploys,
registers or finalizes for it: the driver imports them from here like the rest (a process package
imports no other)."""

from __future__ import annotations

DRIVER_NAME = "loop.csi.kubeloop.dev"
TOPOLOGY_KEY = "topology.loop.csi.kubeloop.dev/node"
