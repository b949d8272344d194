"""Timestamps as the Kubernetes API writes them, in UTC: metav1.Time (RFC 3339, whole seconds) for
Events, conditions and phase transitions, and metav1.MicroTime (microseconds) for Leases.

Each takes an optional `at` so a caller (or a test) can stamp a time of its choosing; without
it, the current time is used. `MonotonicClock` is elapsed time and sleeping for timing policies,
with `SYSTEM_CLOCK` the real one."""

from __future__ import annotations

import asyncio
import datetime
import time
from typing import Protocol


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def now_rfc3339(at: datetime.datetime | None = None) -> str:
    """metav1.Time: `2006-01-02T15:04:05Z`."""
    return (at or utc_now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_time(at: datetime.datetime | None = None) -> str:
    """metav1.MicroTime: `2006-01-02T15:04:05.000000Z`."""
    return (at or utc_now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class MonotonicClock(Protocol):
    """Elapsed time and waiting, behind an interface so that timing policies (restart backoff)
    can be tested on a fake clock that advances instantly."""

    def monotonic(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clock: time.monotonic and asyncio.sleep."""

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK: MonotonicClock = SystemClock()
