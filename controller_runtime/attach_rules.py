"""The attach rules, each decided once: whether a volume may be attached to several nodes, whether a
CSI driver's volumes are attached at all, whether a node is Ready. The controllers that act on them
(the attach-detach controller's `services.attach_detach.decide`, the node agent, the node finalizer)
and the explainer that tells why they did (`kubectl_kubeloop.diagnose`) call these functions, so an
explanation never describes a decision the controller did not make. Each follows
kube-controller-manager; the docstrings name the function it reads. Pure, and light to import: no
gRPC, no client.
"""

from __future__ import annotations

from collections.abc import Iterable

from .kinds import CSIDriver, Node, NodeCondition
from .storage import ROX, RWX


def multi_attach_allowed(access_modes: Iterable[str]) -> bool:
    """Whether a PV with these access modes may be attached to several nodes at once: kcm's
    util.IsMultiAttachAllowed (pkg/volume/util/util.go), which the attach-detach reconciler asks
    before it refuses an attach with a Multi-Attach error. A PV that lists no access modes is
    "unknown, let the attacher fail if needed": allowed. One that lists ReadOnlyMany or
    ReadWriteMany, whatever else it lists, is allowed. Only a PV whose modes are all single-node
    (ReadWriteOnce, ReadWriteOncePod) is exclusive. The volume mode (block or filesystem) plays no
    part."""
    modes = set(access_modes)
    return not modes or bool(modes & {ROX, RWX})


def attach_required(csidriver: CSIDriver | None) -> bool:
    """Whether a CSI driver's volumes are attached (a VolumeAttachment, ControllerPublishVolume)
    before the node stages them: kcm's csiPlugin.skipAttach (pkg/volume/csi/csi_plugin.go), negated.
    No CSIDriver object: required. A CSIDriver whose spec.attachRequired is unset or null:
    required. Only attachRequired false skips the attach."""
    if csidriver is None:
        return True
    return (csidriver.get("spec") or {}).get("attachRequired") is not False


def node_ready_condition(node: Node | None) -> NodeCondition | None:
    """The node's Ready condition, None when it has none (or there is no node)."""
    for cond in ((node or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.copy()
    return None


def node_ready(node: Node | None) -> bool:
    """Whether a node is Ready: its Ready condition's status is "True", kcm's nodeutil.IsNodeReady
    (pkg/util/node/node.go), which the attach-detach reconciler's nodeIsHealthy asks before a
    detach that skips the unmount wait. No node, no Ready condition, "False" or "Unknown": not
    Ready."""
    cond = node_ready_condition(node)
    return cond is not None and cond.get("status") == "True"
