"""Named steps of provisioning where the fault-injection tests can stop the process.

The shipped provisioner installs nothing here: no environment variable or flag arms a failpoint,
and `reach` calls no hook, so it is a loop over an empty list. The test suite starts the
provisioner through a test-only entry module (tests/integration/provisioner_failpoints.py) that
installs a hook (SIGKILL at the named step) and then runs the normal main.
"""

from __future__ import annotations

from controller_runtime.failpoints import Failpoints, Hook

BEFORE_CREATE_VOLUME = "before-create-volume"
AFTER_CREATE_VOLUME = "after-create-volume"
AFTER_PV_SAVED = "after-pv-saved"
POINTS = (BEFORE_CREATE_VOLUME, AFTER_CREATE_VOLUME, AFTER_PV_SAVED)

_STEPS = Failpoints(*POINTS)
# The module's own names, which the provisioner and its test entry module use.
install = _STEPS.install
reach = _STEPS.reach
__all__ = [
    "AFTER_CREATE_VOLUME",
    "AFTER_PV_SAVED",
    "BEFORE_CREATE_VOLUME",
    "POINTS",
    "Hook",
    "install",
    "reach",
]
