"""Topology decisions: which nodes a volume is accessible from, and whether a request's topology
names this node. Pure functions of the request and the node's id; the controller does the I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kubeloop_grpc.csi import csi_pb2

from . import TOPOLOGY_KEY
from .errors import exhausted, invalid


def node_segment(node_id: str, key: str = TOPOLOGY_KEY) -> dict[str, str]:
    """The one topology segment of a node: what NodeGetInfo reports and node-local volumes carry
    (`key`: the driver's topology key, controller_runtime.driver_names.topology_key)."""
    return {key: node_id}


def names_node(segment: Mapping[str, str], node_id: str, key: str = TOPOLOGY_KEY) -> bool:
    """Whether a topology segment is satisfied by the node: every key of the segment must hold on
    it, and the node has only its own key, so a segment with another key (or another node's name)
    is not this node's."""
    return dict(segment) == node_segment(node_id, key)


def checked_requirements(req: csi_pb2.CreateVolumeRequest) -> csi_pb2.TopologyRequirement | None:
    """The request's accessibility requirements, checked to be well formed; None when unset."""
    if not req.HasField("accessibility_requirements"):
        return None
    reqs = req.accessibility_requirements
    if not reqs.requisite and not reqs.preferred:
        raise invalid("accessibility_requirements must name requisite or preferred topologies, or be unset")
    if reqs.requisite and any(p not in reqs.requisite for p in reqs.preferred):
        raise invalid("accessibility_requirements: every preferred topology must also be requisite")
    return reqs


def _described(segments: Sequence[csi_pb2.Topology]) -> str:
    return "; ".join(",".join(f"{k}={v}" for k, v in sorted(t.segments.items())) or "{}" for t in segments)


def local_topology(
    reqs: csi_pb2.TopologyRequirement | None, node_id: str, key: str = TOPOLOGY_KEY
) -> list[dict[str, str]]:
    """The topology of a volume made in a node-local pool: the node itself, and only it. The
    requisite segments (or, without any, the preferred ones) must include this node; otherwise the
    spec's RESOURCE_EXHAUSTED, "unable to provision in accessible_topology", which lets the
    external-provisioner reschedule a WaitForFirstConsumer claim to another node."""
    if reqs is not None:
        kind, allowed = ("requisite", reqs.requisite) if reqs.requisite else ("preferred", reqs.preferred)
        if not any(names_node(t.segments, node_id, key) for t in allowed):
            raise exhausted(
                f"volumes of node {node_id} are node-local (accessible from {key}={node_id} "
                f"only), and the {kind} topology excludes that node: {_described(allowed)[:500]}"
            )
    return [node_segment(node_id, key)]
