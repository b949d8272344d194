"""Every conformance scenario, grouped by the Go test tables they come from. A scenario's index in
ALL names its namespace (cf-<index>) in both modes of a run."""

from __future__ import annotations

from ..model import Scenario
from . import attach, binding, expansion, provisioning, reclaim

ALL: tuple[Scenario, ...] = (
    *binding.SCENARIOS,
    *provisioning.SCENARIOS,
    *reclaim.SCENARIOS,
    *attach.SCENARIOS,
    *expansion.SCENARIOS,
)

_names = [s.name for s in ALL]
assert len(set(_names)) == len(_names), "scenario names must be unique"
