"""How every process takes its stop signals (SIGTERM, SIGINT, SIGHUP), whether it runs on asyncio
(controller_runtime.process) or on threads (controller_runtime.process_threads): the first starts
the clean-up; during it a second Ctrl-C exits at once and a repeated SIGTERM or SIGHUP is only
logged (process.py's docstring says why)."""

from __future__ import annotations

import os
import signal
from typing import Protocol

from .logs import get_logger

log = get_logger("process")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Flag(Protocol):
    """asyncio.Event or threading.Event."""

    def is_set(self) -> bool: ...

    def set(self) -> None: ...


def first_stop(signum: int, stopping: Flag) -> bool:
    """Logs the signal and sets `stopping`; True when it is the first, whose clean-up the caller
    starts."""
    name = signal.Signals(signum).name
    if stopping.is_set():
        if signum == signal.SIGINT:
            log.warning("second Ctrl-C, exiting now", signal=name)
            os._exit(1)
        log.info("already shutting down", signal=name)
        return False
    # Set before the line is written: a handler on threads can be interrupted by the next signal's
    # (Python runs handlers between any two bytecodes), which must find the shutdown under way.
    stopping.set()
    log.info("shutting down", signal=name)
    return True
