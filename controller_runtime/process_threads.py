"""controller_runtime.process's entry for the processes that run on threads instead of asyncio
(node-driver-registrar and livenessprobe: asyncio alone costs 10 MiB of RSS, issue 49).

`run(args, ctx)` is a plain function run in the main thread. The first SIGTERM, SIGINT or SIGHUP
raises `Stopping` there, wherever it waits (an Event, a sleep, a socket), as process.py cancels the
run task: `finally:` blocks do the clean-up and the process exits 0. As there, a second Ctrl-C exits
at once and a further SIGTERM or SIGHUP during the clean-up is only logged; an error out of `run`
is logged as fatal and exits 1."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from types import FrameType

from .health_threads import HealthServer
from .logs import get_logger
from .stop_signals import STOP_SIGNALS, first_stop

log = get_logger("process")


class Stopping(BaseException):
    """Raised in the main thread by the first stop signal (a BaseException, as CancelledError is:
    `except Exception` in the run function does not swallow it)."""


@dataclass
class Context:
    """What the entry hands to a component's run function."""

    health: HealthServer | None
    stopping: threading.Event = field(default_factory=threading.Event)


Run = Callable[[argparse.Namespace, Context], None]


def serve(run: Run, args: argparse.Namespace) -> int:
    endpoint = getattr(args, "http_endpoint", "")
    ctx = Context(health=HealthServer(endpoint) if endpoint else None)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if first_stop(signum, ctx.stopping):
            raise Stopping

    if ctx.health is not None:
        ctx.health.start()
    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        run(args, ctx)
        return 0
    except Stopping:
        return 0
    except Exception:
        log.exception("fatal error")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ctx.health is not None:
            with contextlib.suppress(Exception):
                ctx.health.stop()
