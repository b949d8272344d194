"""controller_runtime.process's entry for the processes that run on threads instead of asyncio
(node-driver-registrar and livenessprobe: asyncio alone costs 10 MiB of RSS, issue 49).

`run(args, ctx)` is a plain function, run on a thread of its own while the main thread only waits
for it and takes the signals, which every other thread blocks (a handler then runs where no lock
of the component's is held). The
first SIGTERM, SIGINT or SIGHUP sets `ctx.stopping` and calls what the component gave `on_stop`:
the component stops at its next wait and returns, its `finally:` blocks doing the clean-up, and
the process exits 0. Nothing is raised into the middle of its code, as process.py's cancellation
does only at an await. As there, a second Ctrl-C exits at once and a further SIGTERM or SIGHUP
during the clean-up is only logged; an error out of `run` is logged as fatal and exits 1."""

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


@dataclass
class Context:
    """What the entry hands to a component's run function."""

    health: HealthServer | None
    stopping: threading.Event = field(default_factory=threading.Event)
    _on_stop: list[Callable[[], None]] = field(default_factory=list)

    def on_stop(self, wake: Callable[[], None]) -> None:
        """`wake` is called at the first stop signal, after `stopping` is set: what wakes a wait of
        the component's on something else than `stopping`; at once when the signal came first."""
        self._on_stop.append(wake)
        if self.stopping.is_set():
            wake()

    def stop(self) -> None:
        self.stopping.set()
        for wake in self._on_stop:
            wake()


Run = Callable[[argparse.Namespace, Context], None]


def serve(run: Run, args: argparse.Namespace) -> int:
    endpoint = getattr(args, "http_endpoint", "")
    ctx = Context(health=HealthServer(endpoint) if endpoint else None)
    failed: list[BaseException] = []

    def work() -> None:
        try:
            run(args, ctx)
        except BaseException as e:
            failed.append(e)
            log.exception("fatal error")

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        if first_stop(signum, ctx.stopping):
            ctx.stop()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    worker = threading.Thread(target=work, name="run", daemon=True)
    try:
        # Every other thread blocks the stop signals (a thread inherits its creator's mask), so the
        # kernel hands them to the main thread, whose wait they interrupt: one taken by another
        # thread would only be noticed when the main thread next woke.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            if ctx.health is not None:
                ctx.health.start()
            worker.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        worker.join()  # signals interrupt the wait: their handler runs here
        return 1 if failed else 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if ctx.health is not None:
            with contextlib.suppress(Exception):
                ctx.health.stop()
