"""Pacing of level-triggered reconcile loops (the attach-detach controller's, the node agent's): a
pass runs when something changed or `period` passed. An event after a quiet spell starts a pass at
once; a flood of events makes fewer, larger passes instead of a busy loop, because a pass starts
no sooner after the last one ended than `floor`, nor than the CPU that one spent deciding (so
that the deciding, which grows with thousands of objects, never takes more than about half the
CPU from everything else; waiting on writes is not counted). `CpuMeter` gathers that CPU from the
blocks of a pass that decide. The waits and the spacing are on the injected clock."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from .clock import SYSTEM_CLOCK, Clock


class PassPacer:
    def __init__(self, wake: asyncio.Event, period: float, floor: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self.wake = wake
        self.period = period
        self.floor = floor
        self.clock = clock
        self._ended = float("-inf")
        self._spacing = 0.0

    def pass_ended(self, cpu_spent: float) -> None:
        """Marks the end of a pass that spent `cpu_spent` seconds of CPU deciding what to do (not
        waiting for its writes: waiting is not work)."""
        self._ended = self.clock.monotonic()
        self._spacing = max(self.floor, cpu_spent)

    async def next_pass(self) -> None:
        """Returns when the next pass should start, with `wake` cleared so that an event during
        that pass calls for another one."""
        with contextlib.suppress(TimeoutError):
            await self.clock.wait_for(self.wake.wait(), self.period)
        delay = self._ended + self._spacing - self.clock.monotonic()
        if delay > 0:
            await self.clock.sleep(delay)
        self.wake.clear()


class CpuMeter:
    """The CPU a pass spent deciding: each `with meter:` block adds the CPU its thread used (the
    blocks are not nested); `take()` returns the sum and starts the next pass's count at zero."""

    def __init__(self, cpu_time: Callable[[], float] = time.thread_time) -> None:
        self._cpu_time = cpu_time
        self._spent = 0.0
        self._began = 0.0

    def __enter__(self) -> CpuMeter:
        self._began = self._cpu_time()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._spent += self._cpu_time() - self._began

    def take(self) -> float:
        spent, self._spent = self._spent, 0.0
        return spent
