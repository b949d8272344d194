"""controller_runtime.mutation_detector: an in-place edit of a cached object is found; the
informer's own replacements are not edits (issue 30)."""

from __future__ import annotations

from controller_runtime import mutation_detector
from controller_runtime.mutation_detector import MutationDetector
from controller_runtime.resources import Obj


def test_an_edit_of_a_cached_object_is_found_once() -> None:
    before = len(mutation_detector.DETECTED)
    detector = MutationDetector("persistentvolumes")
    cached: Obj = {
        "metadata": {"name": "pv1", "resourceVersion": "1"},
        "spec": {"capacity": {"storage": "1Gi"}},
    }
    detector.stored(cached)
    detector.check()
    assert len(mutation_detector.DETECTED) == before
    cached["spec"]["capacity"]["storage"] = "2Gi"  # what a careless handler or worker might do
    detector.check([cached])
    detector.check()
    found = mutation_detector.DETECTED[before:]
    assert [(m.resource, m.key) for m in found] == [("persistentvolumes", "pv1")]
    assert found[0].original["spec"]["capacity"]["storage"] == "1Gi"
    del mutation_detector.DETECTED[before:]


def test_a_forgotten_object_is_no_longer_compared() -> None:
    before = len(mutation_detector.DETECTED)
    detector = MutationDetector("pods")
    old: Obj = {"metadata": {"name": "p", "namespace": "ns"}}
    detector.stored(old)
    detector.forget(old)  # replaced in the store by a newer version
    old["metadata"]["name"] = "edited after it left the cache"
    detector.check()
    assert len(mutation_detector.DETECTED) == before
