"""kubeloop's CSI driver's names, the contract between the driver and every process that deploys,
registers or finalizes for it: the driver imports them from here like the rest (a process package
imports no other)."""

from __future__ import annotations

DRIVER_NAME = "loop.csi.kubeloop.dev"


def topology_key(driver: str) -> str:
    """The node label a driver of this name reports as its one topology key. It follows the name, so
    the driver run under another name (--drivername) labels nodes with a key of its own: a node
    carrying it is one where that driver's plugin runs, which the scheduler and the e2e suite's
    topology specs read from the label alone."""
    return f"topology.{driver}/node"


TOPOLOGY_KEY = topology_key(DRIVER_NAME)
