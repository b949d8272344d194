"""Integration tests run every in-process informer with the cache mutation detector on: a
controller that edits a cached object in place fails the test that made it do so."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from controller_runtime import mutation_detector

os.environ[mutation_detector.ENV] = "true"  # before any test builds an informer


@pytest.fixture(autouse=True)
def no_cache_mutations() -> Iterator[None]:
    before = len(mutation_detector.DETECTED)
    yield
    found = mutation_detector.DETECTED[before:]
    assert not found, "cached objects were mutated in place: " + "; ".join(
        f"{m.resource} {m.key}" for m in found
    )
