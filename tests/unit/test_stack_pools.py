"""The local stack's pool modes (localstack/pools.py): --pool-capacity parsing, the CSIDriver each
mode makes from deploy/csidriver.yaml, the refusal of a cluster made for the other mode, and the
node-local registry's shape."""

from __future__ import annotations

import pytest

from controller_runtime.toolchain import REPO_ROOT
from localstack.components import NODE_LOCAL_REGISTRY, REGISTRY, instance_ports, instances
from localstack.pools import (
    NODE_LOCAL,
    SHARED,
    PoolCapacity,
    PoolOptionError,
    csidriver_conflict,
    csidriver_spec,
    manifests_for_mode,
    parse_pool_capacity,
)

NODES = ("node-a", "node-b")


def test_pool_capacity_for_all_per_node_and_both() -> None:
    assert parse_pool_capacity("", NODE_LOCAL, NODES) == PoolCapacity()
    assert parse_pool_capacity("4Gi", SHARED, NODES).for_node(None) == "4Gi"
    both = parse_pool_capacity("2Gi, node-a=1Gi", NODE_LOCAL, NODES)
    assert (both.for_node("node-a"), both.for_node("node-b")) == ("1Gi", "2Gi")
    per_node = parse_pool_capacity("node-b=4Gi", NODE_LOCAL, NODES)
    assert (per_node.for_node("node-a"), per_node.for_node("node-b")) == ("", "4Gi")


@pytest.mark.parametrize(
    ("text", "mode", "says"),
    [
        ("node-a=1Gi", SHARED, "takes one size"),
        ("node-z=1Gi", NODE_LOCAL, "not a node of this stack"),
        ("node-a=lots", NODE_LOCAL, "is not a size"),
        ("0", NODE_LOCAL, "is not a size"),
        ("1Gi,2Gi", NODE_LOCAL, "two sizes"),
        ("node-a=1Gi,node-a=2Gi", NODE_LOCAL, "two sizes"),
    ],
)
def test_pool_capacity_refusals_say_why(text: str, mode: str, says: str) -> None:
    with pytest.raises(PoolOptionError, match=says):
        parse_pool_capacity(text, mode, NODES)  # type: ignore[arg-type]


def test_node_local_csidriver_is_the_shipped_one_without_attach() -> None:
    texts = [(REPO_ROOT / "deploy" / "csidriver.yaml").read_text()]
    shared = manifests_for_mode(texts, SHARED)
    node_local = manifests_for_mode(texts, NODE_LOCAL)
    assert shared[0]["spec"]["attachRequired"] is True
    assert node_local[0]["spec"] == {**shared[0]["spec"], "attachRequired": False}
    assert node_local[0]["spec"]["storageCapacity"] is True
    assert csidriver_spec(NODE_LOCAL)["attachRequired"] is False


def test_a_cluster_made_for_the_other_mode_is_refused_with_the_way_out() -> None:
    made_shared = {"spec": {"attachRequired": True}}
    assert csidriver_conflict(None, NODE_LOCAL) is None
    assert csidriver_conflict(made_shared, SHARED) is None
    problem = csidriver_conflict(made_shared, NODE_LOCAL)
    assert problem is not None and "--pools shared" in problem and "fresh home" in problem
    assert csidriver_conflict({"spec": {"attachRequired": False}}, SHARED) is not None


def test_node_local_registry_runs_no_controller_plugin_nor_attacher() -> None:
    names = [i.name for i in instances(NODE_LOCAL_REGISTRY, NODES)]
    assert "csi-driver-controller" not in names and "external-attacher" not in names
    for per_node in ("csi-driver-node", "external-provisioner", "external-resizer", "node-agent"):
        assert {f"{per_node}-{n}" for n in NODES} <= set(names)
    # Per-node ports come in blocks of ten: distinct within a stack of up to ten nodes.
    many = [f"n{i}" for i in range(10)]
    for reg in (REGISTRY, NODE_LOCAL_REGISTRY):
        ports = list(instance_ports(reg, many).values())
        assert len(ports) == len(set(ports))
