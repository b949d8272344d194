"""Named steps of provisioning where the fault-injection tests can stop the process.

The shipped provisioner installs nothing here: no environment variable or flag arms a failpoint,
and `reach` calls no hook, so it is a loop over an empty list. The test suite starts the
provisioner through a test-only entry module (tests/integration/provisioner_failpoints.py) that
installs a hook (SIGKILL at the named step) and then runs the normal main.
"""

from __future__ import annotations

from collections.abc import Callable

BEFORE_CREATE_VOLUME = "before-create-volume"
AFTER_CREATE_VOLUME = "after-create-volume"
AFTER_PV_SAVED = "after-pv-saved"
POINTS = (BEFORE_CREATE_VOLUME, AFTER_CREATE_VOLUME, AFTER_PV_SAVED)

Hook = Callable[[str], None]

_hooks: list[Hook] = []


def install(hook: Hook) -> None:
    """Adds a hook called with each point reached. Only tests call this."""
    _hooks.append(hook)


def reach(point: str) -> None:
    for hook in _hooks:
        hook(point)
