"""Where a stack's volumes live: one pool shared by every node (`shared`, the default), or a pool of
its own per node (`node-local`, issue 31), and the size each pool offers (`--pool-capacity`).

Pure values and decisions, shared by `make up` (localstack/main.py, components.py) and the compose
generator (localstack/compose.py): which pool directory a node's driver uses, the CSIDriver object
each mode needs, and whether an existing cluster's CSIDriver was made for the other mode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from controller_runtime.quantity import parse_quantity

PoolMode = Literal["shared", "node-local"]
SHARED: PoolMode = "shared"
NODE_LOCAL: PoolMode = "node-local"
POOL_MODES: tuple[PoolMode, ...] = (SHARED, NODE_LOCAL)

CSIDRIVER_KIND = "CSIDriver"


class PoolOptionError(ValueError):
    """A --pools / --pool-capacity value the stack cannot run with; the message says why."""


@dataclass(frozen=True)
class PoolCapacity:
    """The size a pool offers, per node (`node-a=1Gi,node-b=4Gi`) with an optional default for the
    others (`2Gi`); a pool without a size offers its filesystem's free space (the driver's
    --capacity 0)."""

    default: str = ""
    per_node: Mapping[str, str] = field(default_factory=dict)

    def for_node(self, node: str | None) -> str:
        if node is None:
            return self.default
        return self.per_node.get(node, self.default)


def parse_pool_mode(text: str) -> PoolMode:
    for mode in POOL_MODES:
        if text == mode:
            return mode
    raise PoolOptionError(f"--pools must be one of {', '.join(POOL_MODES)}, not {text!r}")


def _size(text: str, what: str) -> str:
    # A size the driver's --capacity accepts and the apiserver would: a positive resource.Quantity.
    if parse_quantity(text) <= 0:
        raise PoolOptionError(f"--pool-capacity: {what} {text!r} is not a size such as 512Mi or 4Gi")
    return text


def parse_pool_capacity(text: str, mode: PoolMode, nodes: Sequence[str]) -> PoolCapacity:
    """`4Gi` (every pool), `node-a=1Gi,node-b=4Gi` (per node), or both (`2Gi,node-a=1Gi`: node-a
    1Gi, the others 2Gi). A shared pool is one pool: it takes one size only."""
    default = ""
    per_node: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        node, sep, size = item.partition("=")
        if not sep:
            if default:
                raise PoolOptionError(f"--pool-capacity gives two sizes for every pool: {default}, {item}")
            default = _size(item, "size")
            continue
        node = node.strip()
        if mode == SHARED:
            raise PoolOptionError(
                f"--pool-capacity {item!r}: with --pools {SHARED} every node uses the one pool, which "
                f"takes one size (e.g. --pool-capacity 4Gi); per-node sizes need --pools {NODE_LOCAL}"
            )
        if node not in nodes:
            raise PoolOptionError(
                f"--pool-capacity names {node!r}, which is not a node of this stack ({', '.join(nodes)})"
            )
        if node in per_node:
            raise PoolOptionError(f"--pool-capacity gives {node} two sizes")
        per_node[node] = _size(size.strip(), f"the size of {node}")
    return PoolCapacity(default, per_node)


def shared_pool_dir(home: Path) -> Path:
    return home / "pool"


def node_pool_dir(home: Path, node: str) -> Path:
    """A node-local pool: apart from the node's kubelet root (`nodes/<node>/`), so a pool is never
    under a directory the node's mounts propagate through."""
    return home / "pools" / node


def csidriver_spec(mode: PoolMode) -> dict[str, Any]:
    """The CSIDriver spec each mode needs. Node-local volumes are reached only on their own node,
    whose plugin serves them without ControllerPublish: no VolumeAttachment (hostpath's distributed
    deployment); the scheduler weighs CSIStorageCapacity in both modes."""
    return {
        "attachRequired": mode == SHARED,
        "podInfoOnMount": True,
        "volumeLifecycleModes": ["Persistent", "Ephemeral"],
        "storageCapacity": True,
        "fsGroupPolicy": "File",
    }


def for_mode(docs: Iterable[Any], mode: PoolMode) -> list[dict[str, Any]]:
    """The manifests' objects as the mode needs them: deploy/csidriver.yaml is written for the shared
    pool; node-local changes its attachRequired (a copy, the input is left as it is)."""
    out: list[dict[str, Any]] = []
    for doc in docs:
        if not isinstance(doc, dict):  # an empty document (a trailing ---)
            continue
        if doc.get("kind") == CSIDRIVER_KIND and mode == NODE_LOCAL:
            doc = {
                **doc,
                "spec": {**doc.get("spec", {}), "attachRequired": csidriver_spec(mode)["attachRequired"]},
            }
        out.append(doc)
    return out


def manifests_for_mode(texts: Iterable[str], mode: PoolMode) -> list[dict[str, Any]]:
    """The objects of manifest files (each possibly several documents) as the mode needs them."""
    return for_mode((doc for text in texts for doc in yaml.safe_load_all(text)), mode)


def csidriver_conflict(existing: Mapping[str, Any] | None, mode: PoolMode) -> str | None:
    """Why the cluster's CSIDriver object cannot serve `mode`, or None. Its attachRequired cannot be
    changed (the apiserver refuses an update), and the volumes of a cluster made for the other mode
    live in the other pools: say so rather than fail in kubectl apply or lose track of volumes."""
    if existing is None:
        return None
    attach = bool(existing.get("spec", {}).get("attachRequired", True))
    if attach == csidriver_spec(mode)["attachRequired"]:
        return None
    made_for = SHARED if attach else NODE_LOCAL
    return (
        f"this cluster was set up with --pools {made_for} (its CSIDriver has attachRequired: "
        f"{str(attach).lower()}, which cannot be changed) and its volumes live in those pools; "
        f"start --pools {made_for} again, or use a fresh home (another KUBELOOP_HOME, or delete its "
        "etcd/ after a clean stop) for --pools " + mode
    )
