"""Time, in one place: the API's timestamps and the clock every timing policy reads and waits on.

Timestamps as the Kubernetes API writes them, in UTC: metav1.Time (RFC 3339, whole seconds) for
Events, conditions and phase transitions, and metav1.MicroTime (microseconds) for Leases. Each
takes an optional `at` so a caller (or a test) can stamp a time of its choosing (`clock.now()`);
without it, the current time is used.

`Clock` is k8s.io/utils/clock for asyncio: what the workqueue and its rate limiters, leader
election, the operation executor, the pass pacers and the controllers' backoffs read time from and
wait on, so that a test can drive them with `controller_runtime.clock_testing.FakeClock` instead of
sleeping. `PassiveClock` only tells the time (client-go's PassiveClock); `Clock` also waits:
`sleep`, `call_later` (a timer, client-go's AfterFunc) and `wait_for` (an await bounded by a
timeout on this clock). `SYSTEM_CLOCK` is the real one: time.monotonic, the wall clock in UTC,
asyncio.sleep, the running loop's call_later and asyncio.wait_for, exactly what the code called
before it took a clock.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def now_rfc3339(at: datetime.datetime | None = None) -> str:
    """metav1.Time: `2006-01-02T15:04:05Z`."""
    if at is None:
        # The same text without a datetime made and converted: two of every provisioned claim's
        # Events are stamped here.
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return at.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(at: datetime.datetime | None = None) -> str:
    """metav1.MicroTime: `2006-01-02T15:04:05.000000Z`."""
    return (at or utc_now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Timer(Protocol):
    """A callback scheduled by `Clock.call_later`; `cancel` keeps it from running (a no-op once it
    ran). asyncio's TimerHandle is one."""

    def cancel(self) -> None: ...


class PassiveClock(Protocol):
    """Telling the time: elapsed seconds for durations and deadlines, the wall clock for stamps."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (only differences mean anything)."""
        ...

    def now(self) -> datetime.datetime:
        """The wall-clock time, in UTC (what an API timestamp records)."""
        ...


class Clock(PassiveClock, Protocol):
    """Telling the time and waiting on it."""

    async def sleep(self, seconds: float) -> None:
        """Returns after `seconds` on this clock (at once, after one loop turn, for <= 0)."""
        ...

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        """Calls `callback(*args)` in the event loop after `delay` seconds on this clock."""
        ...

    async def wait_for(self, aw: Awaitable[T], timeout: float | None) -> T:
        """asyncio.wait_for with the timeout on this clock: `aw`'s result, or TimeoutError (and
        `aw` cancelled) once `timeout` seconds passed; no timeout for None."""
        ...


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def now(self) -> datetime.datetime:
        return utc_now()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        return asyncio.get_running_loop().call_later(delay, callback, *args)

    async def wait_for(self, aw: Awaitable[T], timeout: float | None) -> T:
        return await asyncio.wait_for(aw, timeout)


SYSTEM_CLOCK: Clock = SystemClock()
