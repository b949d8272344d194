"""A finding's headline: what the bug most likely is, from the oracle that fired and the fault
that preceded it. The oracle says what went wrong (a leak, a failed retry); the fault says which
property of the driver it tested (idempotency, state across a restart, work cut off midway), so
together they name the bug the way a driver developer would look for it."""

from __future__ import annotations

import re

from .faults import Fault, FaultKind
from .oracles import Finding

_FAILED = re.compile(r"^(?P<step>\w+) answered (?P<code>[A-Z_]+)")
# Faults after which the caller sends the very same call again.
_RETRIED = frozenset({FaultKind.KILL_AFTER, FaultKind.DROP, FaultKind.TIMEOUT, FaultKind.KILL_BEFORE})


def headline(fault: Fault | None, finding: Finding) -> str:
    after = f" after {fault}" if fault else " with no fault"
    if finding.kind == "call-failed":
        m = _FAILED.match(finding.summary)
        if m is None:
            return f"a call never succeeded{after}"
        step, code = m.group("step"), m.group("code")
        # The caller only names what the driver created: NOT_FOUND after a restart is forgetting.
        if fault and fault.kind.kills and code == "NOT_FOUND":
            return f"state lost on restart: {step} answered NOT_FOUND once the driver was killed ({fault})"
        if fault and step == fault.method and fault.kind in _RETRIED:
            return f"{step} is not idempotent: its retry{after} answered {code}"
        return f"{step} answered {code}{after}"
    if finding.kind.startswith("leaked-"):
        what = finding.kind.removeprefix("leaked-") + "s"
        if fault and fault.kind is FaultKind.DUPLICATE:
            return f"{fault.method} is not idempotent under a duplicate call: leaked {what}"
        if fault and fault.kind is FaultKind.TIMEOUT:
            return f"{fault.method} cut off by its deadline leaks {what}"
        if fault and fault.kind.kills:
            return f"leaked {what}{after}: work done before the kill was forgotten"
        return f"leaked {what}{after}"
    if finding.kind in ("leftover-mount", "leftover-loop-device"):
        what = "mounts" if finding.kind == "leftover-mount" else "loop devices"
        return f"{what} left behind once every volume was unpublished, unstaged and deleted{after}"
    return f"{finding.kind}{after}"
