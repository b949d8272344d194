"""placeholder"""

from __future__ import annotations

from ..model import Scenario

SCENARIOS: tuple[Scenario, ...] = ()
