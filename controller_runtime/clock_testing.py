"""The fake clock for tests (k8s.io/utils/clock/testing's FakeClock for asyncio): time stands still
until the test moves it, and moving it wakes the sleepers and fires the timers that fell due, in
the order of their deadlines (equal deadlines in the order they were set), so a test of a timing
policy takes no real time and comes out the same every run.

    clock = FakeClock()
    queue = WorkQueue("test", limiter, clock=clock)
    queue.add_after("a", 5)
    await clock.advance(5)        # the timer fires; the loop runs what it woke
    assert await queue.get() == "a"

- `step(seconds)` / `set_time(when)`: move the clock at once, firing everything due by then
  synchronously (client-go's Step and SetTime); the woken tasks run when the test next awaits.
- `advance(seconds)`: move the clock timer by timer, letting the event loop run what each one woke
  before the next (`settle`), so that a loop which sleeps again after waking (a renew loop, a
  poll) wakes at each of its deadlines on the way, as it would in real time.
- `has_waiters()`, `waiting()` and `until_waiting(n)`: whether anything sleeps or waits for a timer
  on this clock, their delays, and waiting (on the loop, not in time) until n of them do, which is
  how a test knows the code under test got to its wait before it steps the clock.

Delays of zero or less never wait for the clock: `sleep` yields once, `call_later` runs the callback
at the loop's next turn, and `wait_for` with a timeout <= 0 behaves as asyncio's.
"""

from __future__ import annotations

import asyncio
import datetime
import heapq
import itertools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .clock import Timer

T = TypeVar("T")

EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


class FakeTimer:
    """A timer on a FakeClock, due at `when` (the clock's monotonic seconds)."""

    __slots__ = ("_args", "_callback", "_clock", "_done", "when")

    def __init__(self, clock: FakeClock, when: float, callback: Callable[..., None], args: tuple[Any, ...]):
        self._clock = clock
        self.when = when
        self._callback = callback
        self._args = args
        self._done = False

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            self._clock._active -= 1

    def cancelled(self) -> bool:
        """Whether it was cancelled or has fired (either way it will not fire again)."""
        return self._done

    def _fire(self) -> None:
        if not self._done:
            self._done = True
            self._clock._active -= 1
            self._callback(*self._args)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class FakeClock:
    """A Clock whose time moves only when the test says so. It starts at `monotonic` seconds and
    the wall-clock time `start` (UTC), and both move together."""

    def __init__(self, start: datetime.datetime = EPOCH, monotonic: float = 1000.0) -> None:
        self._mono = float(monotonic)
        self._origin = float(monotonic)
        self._start = start.astimezone(datetime.UTC)
        self._timers: list[tuple[float, int, FakeTimer]] = []
        self._order = itertools.count()
        self._active = 0
        self._watchers: list[asyncio.Future[None]] = []

    # -- the Clock protocol -----------------------------------------------------------------------

    def monotonic(self) -> float:
        return self._mono

    def now(self) -> datetime.datetime:
        return self._start + datetime.timedelta(seconds=self._mono - self._origin)

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> Timer:
        if delay <= 0:
            return asyncio.get_running_loop().call_soon(callback, *args)
        timer = FakeTimer(self, self._mono + delay, callback, args)
        heapq.heappush(self._timers, (timer.when, next(self._order), timer))
        self._active += 1
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            _wake(watcher)
        return timer

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        timer = self.call_later(seconds, _wake, fut)
        try:
            await fut
        finally:
            timer.cancel()

    async def wait_for(self, aw: Awaitable[T], timeout: float | None) -> T:
        if timeout is None or timeout <= 0:
            return await asyncio.wait_for(aw, timeout)
        loop = asyncio.get_running_loop()
        # asyncio's own timeout scope, expired by a timer on this clock instead of the loop's:
        # cancellation, TimeoutError and an outer cancel behave exactly as in asyncio.wait_for.
        async with asyncio.timeout(None) as scope:
            timer = self.call_later(timeout, lambda: scope.reschedule(loop.time()))
            try:
                return await aw
            finally:
                timer.cancel()

    # -- moving time ------------------------------------------------------------------------------

    def step(self, seconds: float) -> None:
        """Moves the clock `seconds` forward and fires, synchronously and in deadline order,
        every timer due by then (client-go's Step): the clock reads the new time in each."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back (step of {seconds}s)")
        self._mono += seconds
        self._fire_due()

    def set_time(self, when: datetime.datetime) -> None:
        """Moves the clock to the wall-clock time `when` (client-go's SetTime), never back."""
        self.step((when - self.now()).total_seconds())

    async def advance(self, seconds: float) -> None:
        """Moves the clock `seconds` forward one due timer at a time: the clock reads each timer's
        deadline when it fires, and the event loop runs what it woke (`settle`) before the next,
        so timers set on the way fire too if they fall due in time."""
        if seconds < 0:
            raise ValueError(f"a monotonic clock never goes back (advance of {seconds}s)")
        target = self._mono + seconds
        await self.settle()
        while (due := self._next_deadline()) is not None and due <= target:
            self._mono = max(self._mono, due)
            self._fire_due()
            await self.settle()
        self._mono = target

    async def settle(self) -> None:
        """Lets the event loop run until nothing is ready to run (what is left waits on this
        clock, on I/O, or on something the test has yet to do). Takes no time on any clock."""
        loop = asyncio.get_running_loop()
        ready = getattr(loop, "_ready", None)  # asyncio's run queue; uvloop has none to look at
        for _ in range(10_000 if ready is not None else 100):
            await asyncio.sleep(0)
            if ready is not None and not ready:
                return

    def _next_deadline(self) -> float | None:
        while self._timers and self._timers[0][2].cancelled():
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def _fire_due(self) -> None:
        while (due := self._next_deadline()) is not None and due <= self._mono:
            _, _, timer = heapq.heappop(self._timers)
            timer._fire()

    # -- looking at the waiters -------------------------------------------------------------------

    def has_waiters(self) -> bool:
        """Whether a sleeper or a timer waits on this clock (client-go's HasWaiters)."""
        return self._active > 0

    def waiting(self) -> list[float]:
        """The seconds until each waiting sleeper or timer is due, soonest first."""
        return sorted(round(t.when - self._mono, 9) for _, _, t in self._timers if not t.cancelled())

    async def until_waiting(self, count: int = 1) -> None:
        """Returns once at least `count` sleepers or timers wait on this clock. It waits for the
        code under test to get there, not for any time to pass; a test that expects a wait which
        never comes bounds this with a real timeout (`asyncio.wait_for(..., 5)`)."""
        loop = asyncio.get_running_loop()
        while self._active < count:
            watcher: asyncio.Future[None] = loop.create_future()
            self._watchers.append(watcher)
            await watcher
