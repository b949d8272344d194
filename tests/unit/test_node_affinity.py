"""A PV's required node affinity against a Node, as MatchNodeSelectorTerms judges it, and which
volumes a resizer in node deployment serves."""

from __future__ import annotations

import pytest

from controller_runtime.kinds import node_view, pv_view
from controller_runtime.node_affinity import selector_matches
from controller_runtime.resources import Obj
from external_resizer.decide import served_by_node

KEY = "topology.loop.csi.kubeloop.dev/node"
NODE_B: Obj = {"metadata": {"name": "node-b", "labels": {KEY: "node-b", "rack": "7"}}}


def terms(*terms: Obj) -> Obj:
    return {"nodeSelectorTerms": list(terms)}


def expr(key: str, op: str, *values: str) -> Obj:
    return {"key": key, "operator": op, "values": list(values)} if values else {"key": key, "operator": op}


def pv(required: Obj | None) -> Obj:
    spec: Obj = {"csi": {"driver": "loop.csi.kubeloop.dev", "volumeHandle": "v"}}
    if required is not None:
        spec["nodeAffinity"] = {"required": required}
    return {"metadata": {"name": "pv"}, "spec": spec}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (terms({"matchExpressions": [expr(KEY, "In", "node-b")]}), True),
        (terms({"matchExpressions": [expr(KEY, "In", "node-a")]}), False),
        # Terms are ORed, a term's expressions ANDed.
        (
            terms(
                {"matchExpressions": [expr(KEY, "In", "node-a")]},
                {"matchExpressions": [expr("rack", "Exists")]},
            ),
            True,
        ),
        (terms({"matchExpressions": [expr(KEY, "In", "node-b"), expr("rack", "DoesNotExist")]}), False),
        (terms({"matchExpressions": [expr(KEY, "NotIn", "node-a")]}), True),
        (terms({"matchExpressions": [expr("rack", "Gt", "6")]}), True),
        (terms({"matchExpressions": [expr("rack", "Lt", "6")]}), False),
        (terms({"matchExpressions": [expr("zone", "Gt", "6")]}), False),
        # matchFields: metadata.name only, In/NotIn with one value.
        (terms({"matchFields": [expr("metadata.name", "In", "node-b")]}), True),
        (terms({"matchFields": [expr("metadata.name", "NotIn", "node-b")]}), False),
        (terms({"matchFields": [expr("metadata.name", "In", "node-b", "node-c")]}), False),
        (terms({"matchFields": [expr("metadata.uid", "In", "node-b")]}), False),
        # Malformed requirements fail their term; an empty term or no term matches nothing.
        (terms({"matchExpressions": [expr(KEY, "In")]}), False),
        (terms({"matchExpressions": [expr(KEY, "Exists", "node-b")]}), False),
        (terms({"matchExpressions": [expr(KEY, "Like", "node-b")]}), False),
        (terms({"matchExpressions": [expr("rack", "Gt", "six")]}), False),
        (terms({}), False),
        (terms(), False),
    ],
)
def test_node_selector(selector: Obj, expected: bool) -> None:
    assert selector_matches(selector, NODE_B) is expected


def test_a_node_deployment_serves_only_volumes_pinned_where_its_node_is() -> None:
    pinned_b = pv(terms({"matchExpressions": [expr(KEY, "In", "node-b")]}))
    pinned_a = pv(terms({"matchExpressions": [expr(KEY, "In", "node-a")]}))
    node_b = node_view(NODE_B)
    assert served_by_node(pv_view(pinned_b), node_b)
    assert not served_by_node(pv_view(pinned_a), node_b)
    # No affinity: reachable everywhere, so every node's resizer would expand it at once; none does.
    assert not served_by_node(pv_view(pv(None)), node_b)
    # Its own Node not seen yet: nothing is served.
    assert not served_by_node(pv_view(pinned_b), None)
