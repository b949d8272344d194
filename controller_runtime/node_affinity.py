"""A node selector (a PV's `spec.nodeAffinity.required`) against a Node, as Kubernetes'
component-helpers MatchNodeSelectorTerms judges it: the terms are ORed, a term's requirements
ANDed; a term with no requirement, or one that cannot be parsed, matches nothing. matchFields knows
one field, `metadata.name`, with In or NotIn and exactly one value."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .resources import Obj

NAME_FIELD = "metadata.name"


def _expression_matches(expr: Obj, labels: Mapping[str, str]) -> bool | None:
    """Whether a matchExpressions requirement holds for `labels`; None when it is malformed (an
    unknown operator, or values its operator cannot take), which makes its term fail."""
    key, op = str(expr.get("key") or ""), str(expr.get("operator") or "")
    values = [str(v) for v in expr.get("values") or []]
    if op in ("In", "NotIn"):
        if not values:
            return None
        found = key in labels and labels[key] in values
        return found if op == "In" else not found
    if op in ("Exists", "DoesNotExist"):
        if values:
            return None
        return (key in labels) == (op == "Exists")
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            return None
        try:
            want = int(values[0])
        except ValueError:
            return None
        try:
            have = int(labels[key]) if key in labels else None
        except ValueError:
            return False  # a label that is no integer satisfies neither
        return have is not None and (have > want if op == "Gt" else have < want)
    return None


def _field_matches(expr: Obj, name: str) -> bool | None:
    op, values = str(expr.get("operator") or ""), [str(v) for v in expr.get("values") or []]
    if expr.get("key") != NAME_FIELD or op not in ("In", "NotIn") or len(values) != 1:
        return None
    return (values[0] == name) == (op == "In")


def _term_matches(term: Obj, labels: Mapping[str, str], name: str) -> bool:
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False
    results = [_expression_matches(e, labels) for e in exprs] + [_field_matches(f, name) for f in fields]
    return all(r is True for r in results)


def selector_matches(selector: Obj, node: Mapping[str, Any]) -> bool:
    """Whether a NodeSelector (`nodeSelectorTerms`) is satisfied by `node`'s labels and name."""
    md = node.get("metadata") or {}
    labels, name = md.get("labels") or {}, str(md.get("name") or "")
    return any(_term_matches(t, labels, name) for t in selector.get("nodeSelectorTerms") or [])


def required_affinity(pv: Mapping[str, Any]) -> Obj | None:
    """A PV's `spec.nodeAffinity.required`, or None when it has none."""
    required = ((pv.get("spec") or {}).get("nodeAffinity") or {}).get("required")
    return required or None
