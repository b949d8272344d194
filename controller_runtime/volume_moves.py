"""Moving a node-local volume to another node (`kubectl kubeloop move`, `drain`): the contract
between the command that asks for a move and the two node plugins that carry it out, written on
the PersistentVolume itself so that any of them can be killed at any step and the rest, restarted,
finds where the move stands (docs/volume-moves.md).

The command writes the intent; the plugins do the rest, each on its own side:

1. `kubectl kubeloop move` labels the PV with `to` and `from` (each the hash of a node name, so a
   plugin's informer selects exactly the PVs that concern its node) and annotates it with the two
   node names.
2. The source node's plugin marks its copy as leaving (its record, durably: from then on it refuses
   to stage the volume, so its data cannot change) and annotates the PV `source-ready`.
3. The target node's plugin pulls the volume from the source's, under the same volume id, then, in
   one patch, points the PV's node affinity at its own node and drops the `to` label.
4. The source node's plugin, seeing the PV point elsewhere, deletes its copy and drops the `from`
   label and the move's annotations: the move is over.

Removing both labels before step 3 cancels the move: the target discards what it pulled, the
source stops refusing to stage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

from .kinds import PersistentVolume, VolumeNodeAffinity

PREFIX = "move.loop.csi.kubeloop.dev"
TO_LABEL = f"{PREFIX}/to"
FROM_LABEL = f"{PREFIX}/from"
TO_ANNOTATION = f"{PREFIX}/to-node"
FROM_ANNOTATION = f"{PREFIX}/from-node"
# Written by the source's plugin once its copy can no longer change.
SOURCE_READY_ANNOTATION = f"{PREFIX}/source-ready"
# What the plugins last did or what stops them, for `kubectl kubeloop move` to show.
STATE_ANNOTATION = f"{PREFIX}/state"


def node_label_value(node: str) -> str:
    """A label value standing for a node name: node names may be 253 characters, label values 63,
    so the label holds a hash and the annotation the name."""
    return hashlib.sha256(node.encode()).hexdigest()[:20]


def node_affinity(topology_key: str, node: str) -> VolumeNodeAffinity:
    """The node affinity kubeloop's provisioner gives a node-local volume: that node alone."""
    return {
        "required": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": topology_key, "operator": "In", "values": [node]}]}
            ]
        }
    }


def affinity_node(pv: PersistentVolume, topology_key: str) -> str:
    """The one node a node-local PV's affinity names under `topology_key`, or "" when it names
    none or several."""
    terms = pv.get("spec", {}).get("nodeAffinity", {}).get("required", {}).get("nodeSelectorTerms", [])
    nodes = {
        value
        for term in terms
        for expr in term.get("matchExpressions", [])
        if expr.get("key") == topology_key and expr.get("operator") == "In"
        for value in expr.get("values", [])
    }
    return next(iter(nodes)) if len(nodes) == 1 else ""


def intent_patch(source: str, target: str, resource_version: str) -> dict[str, Any]:
    """The merge patch that asks for a move (step 1), made on the PV as it was checked."""
    return {
        "metadata": {
            "resourceVersion": resource_version,
            "labels": {TO_LABEL: node_label_value(target), FROM_LABEL: node_label_value(source)},
            "annotations": {
                TO_ANNOTATION: target,
                FROM_ANNOTATION: source,
                STATE_ANNOTATION: f"waiting for node {source} to release the volume",
                SOURCE_READY_ANNOTATION: None,
            },
        }
    }


def cancel_patch(resource_version: str = "") -> dict[str, Any]:
    """The merge patch that abandons a move that has not switched yet, or ends one that has (made
    on the PV of `resource_version` when given)."""
    return {
        "metadata": {
            **({"resourceVersion": resource_version} if resource_version else {}),
            "labels": {TO_LABEL: None, FROM_LABEL: None},
            "annotations": {
                TO_ANNOTATION: None,
                FROM_ANNOTATION: None,
                STATE_ANNOTATION: None,
                SOURCE_READY_ANNOTATION: None,
            },
        }
    }


def moving(annotations: Mapping[str, str]) -> tuple[str, str] | None:
    """(source, target) of the move a PV's annotations describe, or None."""
    source, target = annotations.get(FROM_ANNOTATION, ""), annotations.get(TO_ANNOTATION, "")
    return (source, target) if source and target else None
