"""The one way a test waits, as Gomega's Eventually and Consistently.

`eventually(what, probe)` polls `probe` until it returns a truthy value and returns that value; at
the timeout it fails with `what` and the last value the probe returned (or the last exception it
raised of the kinds it was told to ignore). `consistently(what, probe, duration)` checks `probe`
on every poll for the whole duration and fails at the first falsy value, with what it saw and when:
a test that asserts that something does not happen watches the whole interval instead of sleeping
a guessed time and looking once at the end. `eventually_async` and `consistently_async` are for
tests that await: their probe is a coroutine function, and the event loop runs between probes.

As Gomega's matchers, `satisfied` says what a wanted value is (truthy unless told otherwise: a
probe that lists what is still wrong waits with `satisfied=no_problems`), and `context`, called only
when the wait fails, adds what explains it (a log's tail).

Where a component counts its own progress (a resync, a pass, an idle queue), waiting on that count
says more than either; these are for the rest.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

T = TypeVar("T")

EVENTUALLY_TIMEOUT = 30.0
INTERVAL = 0.1

Ignored = tuple[type[BaseException], ...]
Context = Callable[[], object] | None


def no_problems(problems: object) -> bool:
    """`satisfied` for a probe that returns what is still wrong: nothing is."""
    return operator.not_(problems)


class WaitFailed(AssertionError):
    """A wait that ended without what it waited for (eventually) or saw it fail (consistently)."""


@dataclass
class _Poll:
    """One wait's bookkeeping: its deadline, how many probes ran and the last thing one saw."""

    what: str
    window: float
    ignoring: Ignored
    satisfied: Callable[[Any], object]
    context: Context
    started: float = 0.0
    polls: int = 0
    last: object = "no probe finished"

    def __post_init__(self) -> None:
        self.started = time.monotonic()

    def over(self) -> bool:
        return time.monotonic() - self.started >= self.window

    def saw(self, value: object) -> bool:
        self.polls += 1
        self.last = value
        return bool(self.satisfied(value))

    def raised(self, err: BaseException) -> None:
        """A probe that raised one of the exceptions to ignore saw nothing wanted; another fails."""
        if not isinstance(err, self.ignoring):
            raise err
        self.polls += 1
        self.last = f"{type(err).__name__}: {err}"

    def timed_out(self) -> WaitFailed:
        return self._failed(
            f"timed out after {self.window:g}s waiting for {self.what}; "
            f"the last of {self.polls} probes saw: {self.last!r}"
        )

    def violated(self) -> WaitFailed:
        return self._failed(
            f"{self.what}: failed {time.monotonic() - self.started:.2f}s into {self.window:g}s "
            f"(probe {self.polls}) with {self.last!r}"
        )

    def _failed(self, message: str) -> WaitFailed:
        return WaitFailed(message if self.context is None else f"{message}\n{self.context()}")


@overload
def eventually(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    ignoring: Ignored = (),
    context: Context = None,
) -> T: ...  # a truthy value: never None


@overload
def eventually(
    what: str,
    probe: Callable[[], T],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object],
    ignoring: Ignored = (),
    context: Context = None,
) -> T: ...


def eventually(
    what: str,
    probe: Callable[[], T],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object] = bool,
    ignoring: Ignored = (),
    context: Context = None,
) -> T:
    """Poll `probe` every `interval` seconds until its value satisfies `satisfied` (is truthy),
    and return that value. Exceptions of the kinds in `ignoring` count as a value that does not;
    any other fails at once."""
    poll = _Poll(what, timeout, ignoring, satisfied, context)
    while True:
        try:
            if poll.saw(value := probe()):
                return value
        except Exception as err:
            poll.raised(err)
        if poll.over():
            raise poll.timed_out()
        time.sleep(interval)


def consistently(
    what: str,
    probe: Callable[[], T],
    duration: float,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object] = bool,
    context: Context = None,
) -> T:
    """Check `probe` every `interval` seconds for `duration` seconds (its first check at once, its
    last at the end); fail at the first value that does not satisfy `satisfied`, with that value.
    Returns the last value."""
    poll = _Poll(what, duration, (), satisfied, context)
    while True:
        if not poll.saw(value := probe()):
            raise poll.violated()
        if poll.over():
            return value
        time.sleep(interval)


@overload
async def eventually_async(
    what: str,
    probe: Callable[[], Awaitable[T | None]],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    ignoring: Ignored = (),
    context: Context = None,
) -> T: ...  # a truthy value: never None


@overload
async def eventually_async(
    what: str,
    probe: Callable[[], Awaitable[T]],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object],
    ignoring: Ignored = (),
    context: Context = None,
) -> T: ...


async def eventually_async(
    what: str,
    probe: Callable[[], Awaitable[T]],
    timeout: float = EVENTUALLY_TIMEOUT,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object] = bool,
    ignoring: Ignored = (),
    context: Context = None,
) -> T:
    """`eventually` for a test that awaits: `probe` is a coroutine function, and the event loop
    runs between probes."""
    poll = _Poll(what, timeout, ignoring, satisfied, context)
    while True:
        try:
            if poll.saw(value := await probe()):
                return value
        except Exception as err:
            poll.raised(err)
        if poll.over():
            raise poll.timed_out()
        await asyncio.sleep(interval)


async def consistently_async(
    what: str,
    probe: Callable[[], Awaitable[T]],
    duration: float,
    interval: float = INTERVAL,
    *,
    satisfied: Callable[[T], object] = bool,
    context: Context = None,
) -> T:
    """`consistently` for a test that awaits, as `eventually_async`."""
    poll = _Poll(what, duration, (), satisfied, context)
    while True:
        if not poll.saw(value := await probe()):
            raise poll.violated()
        if poll.over():
            return value
        await asyncio.sleep(interval)
