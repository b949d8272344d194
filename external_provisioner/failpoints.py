"""Crash points for the fault-injection tests: `KUBELOOP_PROVISIONER_FAILPOINTS=after-create-volume`
makes the process SIGKILL itself the first time it reaches that step, exactly like `kill -9` at that
line. Unset (always, outside tests), `reach` is a dictionary lookup."""

from __future__ import annotations

import os
import signal

from controller_runtime.logs import get_logger

log = get_logger("external-provisioner")

BEFORE_CREATE_VOLUME = "before-create-volume"
AFTER_CREATE_VOLUME = "after-create-volume"
AFTER_PV_SAVED = "after-pv-saved"

_ARMED = frozenset(filter(None, os.environ.get("KUBELOOP_PROVISIONER_FAILPOINTS", "").split(",")))


def reach(point: str) -> None:
    if point in _ARMED:
        log.warning("failpoint reached, killing the process", failpoint=point)
        os.kill(os.getpid(), signal.SIGKILL)
