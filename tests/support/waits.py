"""The one way a test waits, as Gomega's Eventually and Consistently.

`eventually(what, probe)` polls `probe` until it returns a truthy value and returns that value; at
the timeout it fails with `what` and the last value the probe returned (or the last exception it
raised of the kinds it was told to ignore). `consistently(what, probe, duration)` checks `probe`
on every poll for the whole duration and fails at the first falsy value, with what it saw and when:
a test that asserts that something does not happen watches the whole interval instead of sleeping
a guessed time and looking once at the end. `eventually_async` and `consistently_async` take a
coroutine function for tests that await.

Where a component counts its own progress (a resync, a pass, an idle queue), waiting on that count
says more than either; these are for the rest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")

EVENTUALLY_TIMEOUT = 30.0
INTERVAL = 0.1

Ignored = tuple[type[BaseException], ...]


class WaitFailed(AssertionError):
    """A wait that ended without what it waited for (eventually) or saw it fail (consistently)."""


@dataclass
class _Poll:
    """One wait's bookkeeping: its deadline, how many probes ran and the last thing one saw."""

    what: str
    window: float
    ignoring: Ignored
    started: float = 0.0
    polls: int = 0
    last: object = "no probe finished"

    def __post_init__(self) -> None:
        self.started = time.monotonic()

    def over(self) -> bool:
        return time.monotonic() - self.started >= self.window

    def saw(self, value: object) -> object:
        self.polls += 1
        self.last = value
        return value

    def raised(self, err: BaseException) -> None:
        if not isinstance(err, self.ignoring):
            raise err
        self.saw(f"{type(err).__name__}: {err}")

    def timed_out(self) -> WaitFailed:
        return WaitFailed(
            f"timed out after {self.window:g}s waiting for {self.what}; "
            f"the last of {self.polls} probes saw: {self.last!r}"
        )

    def violated(self) -> WaitFailed:
        return WaitFailed(
            f"{self.what}: failed {time.monotonic() - self.started:.2f}s into {self.window:g}s "
            f"(probe {self.polls}) with {self.last!r}"
        )


def eventually(
    what: str,
    probe: Callable[[], T],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    ignoring: Ignored = (),
) -> T:
    """Poll `probe` every `interval` seconds until it returns a truthy value, and return that value.
    Exceptions of the kinds in `ignoring` count as a falsy value; any other fails at once."""
    poll = _Poll(what, timeout, ignoring)
    while True:
        try:
            if value := poll.saw(probe()):
                return value  # type: ignore[return-value]
        except Exception as err:
            poll.raised(err)
        if poll.over():
            raise poll.timed_out()
        time.sleep(interval)


def consistently(what: str, probe: Callable[[], T], duration: float, interval: float = INTERVAL) -> T:
    """Check `probe` every `interval` seconds for `duration` seconds (its first check at once, its
    last at the end); fail at the first falsy value with what it returned. Returns the last value."""
    poll = _Poll(what, duration, ())
    while True:
        if not poll.saw(probe()):
            raise poll.violated()
        if poll.over():
            return poll.last  # type: ignore[return-value]
        time.sleep(interval)


async def eventually_async(
    what: str,
    probe: Callable[[], Awaitable[T]],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    ignoring: Ignored = (),
) -> T:
    """`eventually` for a coroutine function: awaits `probe()` until it gives a truthy value."""
    poll = _Poll(what, timeout, ignoring)
    while True:
        try:
            if value := poll.saw(await probe()):
                return value  # type: ignore[return-value]
        except Exception as err:
            poll.raised(err)
        if poll.over():
            raise poll.timed_out()
        await asyncio.sleep(interval)


async def consistently_async(
    what: str, probe: Callable[[], Awaitable[T]], duration: float, interval: float = INTERVAL
) -> T:
    """`consistently` for a coroutine function."""
    poll = _Poll(what, duration, ())
    while True:
        if not poll.saw(await probe()):
            raise poll.violated()
        if poll.over():
            return poll.last  # type: ignore[return-value]
        await asyncio.sleep(interval)
