"""Event aggregation: repeats become count updates on one Event."""

from __future__ import annotations

from controller_runtime.events import EventCorrelator, EventRecorder, object_reference
from controller_runtime.resources import Obj

CLAIM: Obj = {
    "kind": "PersistentVolumeClaim",
    "apiVersion": "v1",
    "metadata": {"name": "data", "namespace": "ns", "uid": "u1", "resourceVersion": "5"},
}


def recorder() -> EventRecorder:
    return EventRecorder(client=None, component="persistentvolume-controller", host="")  # type: ignore[arg-type]


def stored(event: Obj) -> Obj:
    return {**event, "metadata": {**event["metadata"]}}


def test_event_shape() -> None:
    ev = recorder().build(CLAIM, "Warning", "FailedBinding", "no persistent volumes available")
    assert ev["involvedObject"] == object_reference(CLAIM)
    assert ev["involvedObject"]["uid"] == "u1"
    assert ev["metadata"]["namespace"] == "ns"
    assert ev["metadata"]["name"].startswith("data.")
    assert ev["source"] == {"component": "persistentvolume-controller"}
    assert ev["count"] == 1


def test_repeats_aggregate_into_count() -> None:
    rec, corr = recorder(), EventCorrelator()
    first = rec.build(CLAIM, "Warning", "FailedBinding", "no persistent volumes available")
    assert corr.observe(first) is None
    corr.remember(stored(first))
    for expected in (2, 3, 4):
        agg = corr.observe(rec.build(CLAIM, "Warning", "FailedBinding", "no persistent volumes available"))
        assert agg is not None
        assert agg.name == first["metadata"]["name"]
        assert agg.count == expected


def test_different_message_reason_or_object_is_a_new_event() -> None:
    rec, corr = recorder(), EventCorrelator()
    corr.remember(stored(rec.build(CLAIM, "Warning", "FailedBinding", "a")))
    assert corr.observe(rec.build(CLAIM, "Warning", "FailedBinding", "b")) is None
    assert corr.observe(rec.build(CLAIM, "Normal", "FailedBinding", "a")) is None
    assert corr.observe(rec.build(CLAIM, "Warning", "ProvisioningFailed", "a")) is None
    other = {**CLAIM, "metadata": {**CLAIM["metadata"], "uid": "u2"}}
    assert corr.observe(rec.build(other, "Warning", "FailedBinding", "a")) is None


def test_correlator_is_bounded() -> None:
    rec, corr = recorder(), EventCorrelator(capacity=2)
    for msg in ("a", "b", "c"):
        corr.remember(stored(rec.build(CLAIM, "Normal", "R", msg)))
    assert corr.observe(rec.build(CLAIM, "Normal", "R", "a")) is None, "oldest entry evicted"
    assert corr.observe(rec.build(CLAIM, "Normal", "R", "c")) is not None
