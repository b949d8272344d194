"""The API's timestamp formats, the system clock and the fake clock the timing tests run on."""

from __future__ import annotations

import asyncio
import datetime
import time

import pytest

from controller_runtime.clock import SystemClock, micro_time, now_rfc3339
from controller_runtime.clock_testing import FakeClock

AT = datetime.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=datetime.UTC)


def test_formats() -> None:
    assert now_rfc3339(AT) == "2026-01-02T03:04:05Z"
    assert micro_time(AT) == "2026-01-02T03:04:05.678901Z"
    # Another zone is converted to UTC.
    cet = AT.astimezone(datetime.timezone(datetime.timedelta(hours=1)))
    assert now_rfc3339(cet) == "2026-01-02T03:04:05Z"


def test_now_is_utc() -> None:
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    stamp = datetime.datetime.strptime(now_rfc3339(), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    assert before - datetime.timedelta(seconds=1) <= stamp <= before + datetime.timedelta(seconds=2)


# -- the Clock: the real one, and the fake one every timing test runs on --------------------------


async def test_system_clock_is_the_monotonic_clock_and_the_loop() -> None:
    clock = SystemClock()
    loop = asyncio.get_running_loop()
    before = time.monotonic()
    assert before <= clock.monotonic() <= time.monotonic()
    assert abs((clock.now() - datetime.datetime.now(datetime.UTC)).total_seconds()) < 1
    fired = asyncio.Event()
    timer = clock.call_later(0, fired.set)
    assert isinstance(timer, asyncio.TimerHandle), "the loop's own timer"
    await asyncio.wait_for(fired.wait(), 5)
    await clock.sleep(0)
    assert await clock.wait_for(asyncio.sleep(0, "done"), 5) == "done"
    with pytest.raises(TimeoutError):
        await clock.wait_for(loop.create_future(), 0)


async def test_fake_time_stands_still_until_stepped_and_the_wall_clock_moves_with_it() -> None:
    clock = FakeClock(AT, monotonic=50.0)
    assert (clock.monotonic(), clock.now()) == (50.0, AT)
    clock.step(1.5)
    assert (clock.monotonic(), clock.now()) == (51.5, AT + datetime.timedelta(seconds=1.5))
    clock.set_time(AT + datetime.timedelta(seconds=10))
    assert clock.monotonic() == 60.0
    with pytest.raises(ValueError):
        clock.step(-1)
    with pytest.raises(ValueError):
        clock.set_time(AT)


async def test_a_sleeper_wakes_when_its_time_is_stepped_past_and_not_before() -> None:
    clock = FakeClock()
    sleeper = asyncio.create_task(clock.sleep(2))
    await clock.until_waiting()
    assert clock.has_waiters() and clock.waiting() == [2.0]
    clock.step(1.999)
    await clock.settle()
    assert not sleeper.done()
    clock.step(0.001)
    await clock.settle()
    assert sleeper.done() and not clock.has_waiters()


async def test_timers_fire_in_deadline_order_and_a_cancelled_one_never() -> None:
    clock = FakeClock()
    fired: list[str] = []
    clock.call_later(3, fired.append, "c")
    clock.call_later(1, fired.append, "a")
    clock.call_later(3, fired.append, "d")  # same deadline as c: in the order set
    cancelled = clock.call_later(2, fired.append, "x")
    clock.call_later(2, lambda: fired.append(f"b at {clock.monotonic() - 1000:g}"))
    cancelled.cancel()
    assert clock.waiting() == [1.0, 2.0, 3.0, 3.0]
    clock.step(10)
    assert fired == ["a", "b at 10", "c", "d"], "step sets the time first, as client-go's Step"
    assert not clock.has_waiters()
    now: list[float] = []
    clock.call_later(0, lambda: now.append(clock.monotonic()))
    assert not clock.has_waiters(), "a zero delay does not wait for the clock"
    await clock.settle()
    assert now == [1010.0]


async def test_advance_wakes_a_loop_at_each_of_its_deadlines() -> None:
    clock = FakeClock()
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            await clock.sleep(1)
            ticks.append(clock.monotonic() - 1000)

    task = asyncio.create_task(ticker())
    await clock.advance(3.5)
    assert ticks == [1, 2, 3] and clock.monotonic() == 1003.5
    clock.step(10)  # one step wakes the sleeper once: it sleeps again from the new time
    await clock.settle()
    assert ticks == [1, 2, 3, 13.5]
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not clock.has_waiters(), "a cancelled sleep leaves no timer behind"


async def test_wait_for_times_out_on_the_fake_clock_only() -> None:
    clock = FakeClock()
    loop = asyncio.get_running_loop()
    never: asyncio.Future[None] = loop.create_future()
    waiter = asyncio.create_task(clock.wait_for(never, 5))
    await clock.until_waiting()
    await clock.advance(4.9)
    assert not waiter.done()
    await clock.advance(0.1)
    with pytest.raises(TimeoutError):
        await waiter
    assert never.cancelled(), "what it waited for is cancelled, as asyncio.wait_for does"
    answer: asyncio.Future[str] = loop.create_future()
    waiter2 = asyncio.create_task(clock.wait_for(answer, 5))
    await clock.until_waiting()
    answer.set_result("ok")
    assert await waiter2 == "ok"
    assert not clock.has_waiters(), "the timeout's timer is gone with the wait"
    outer = asyncio.create_task(clock.wait_for(loop.create_future(), 5))
    await clock.until_waiting()
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert not clock.has_waiters()
    assert await clock.wait_for(asyncio.sleep(0, "now"), None) == "now"
    with pytest.raises(TimeoutError):
        await clock.wait_for(loop.create_future(), 0)


async def test_until_waiting_waits_for_the_code_under_test_not_for_time() -> None:
    clock = FakeClock()

    async def two_sleepers() -> None:
        await asyncio.sleep(0)
        await asyncio.gather(clock.sleep(1), clock.sleep(2))

    task = asyncio.create_task(two_sleepers())
    await asyncio.wait_for(clock.until_waiting(2), 5)
    assert clock.waiting() == [1.0, 2.0] and clock.monotonic() == 1000.0
    await clock.advance(2)
    await task
