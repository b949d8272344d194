"""PassPacer: when a level-triggered loop starts its next pass (on a fake clock: no waiting)."""

from __future__ import annotations

import asyncio

from controller_runtime.clock_testing import FakeClock
from controller_runtime.passes import CpuMeter, PassPacer


def pacer(clock: FakeClock) -> tuple[PassPacer, asyncio.Event]:
    wake = asyncio.Event()
    return PassPacer(wake, period=0.1, floor=0.01, clock=clock), wake


async def rest_of(clock: FakeClock, p: PassPacer) -> tuple[asyncio.Task[None], list[float]]:
    """Starts the next pass's wait and returns it with the waits it is in on the clock once it
    got there (the period's timeout, or the rest after the last pass)."""
    task = asyncio.create_task(p.next_pass())
    await clock.settle()
    return task, clock.waiting()


async def test_an_event_after_a_quiet_spell_starts_a_pass_at_once() -> None:
    clock = FakeClock()
    p, wake = pacer(clock)
    p.pass_ended(cpu_spent=0.001)
    clock.step(5.0)  # quiet
    wake.set()
    task, waits = await rest_of(clock, p)
    assert task.done() and waits == [], "no rest"
    assert not wake.is_set(), "cleared for the events of the pass that starts now"


async def test_events_right_after_a_pass_wait_for_the_floor() -> None:
    clock = FakeClock()
    p, wake = pacer(clock)
    p.pass_ended(cpu_spent=0.001)
    clock.step(0.004)
    wake.set()
    task, waits = await rest_of(clock, p)
    assert waits == [0.006]
    await clock.advance(0.006)
    assert task.done()


async def test_a_pass_that_spent_more_cpu_than_the_floor_is_followed_by_as_long_a_rest() -> None:
    clock = FakeClock()
    p, wake = pacer(clock)
    p.pass_ended(cpu_spent=0.05)
    wake.set()
    task, waits = await rest_of(clock, p)
    assert waits == [0.05]
    await clock.advance(0.049)
    assert not task.done()
    await clock.advance(0.001)
    assert task.done()


async def test_without_events_a_pass_starts_after_the_period() -> None:
    clock = FakeClock()
    p, _wake = pacer(clock)
    p.pass_ended(cpu_spent=0.001)
    task, waits = await rest_of(clock, p)
    assert waits == [0.1]
    await clock.advance(0.099)
    assert not task.done()
    await clock.advance(0.001)
    assert task.done() and not clock.has_waiters()


async def test_an_event_during_the_rest_is_left_for_the_pass_that_follows_it() -> None:
    clock = FakeClock()
    p, wake = pacer(clock)
    p.pass_ended(cpu_spent=0.0)
    wake.set()
    task, waits = await rest_of(clock, p)
    assert waits == [0.01]
    wake.set()  # an event while resting
    await clock.advance(0.01)
    assert task.done()
    assert not wake.is_set(), "the pass about to start sees that event's state already"


def test_cpu_meter_sums_the_deciding_blocks_of_one_pass() -> None:
    readings = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125])
    meter = CpuMeter(cpu_time=lambda: next(readings))
    with meter:
        pass
    with meter:  # a second block of the same pass (the node agent's pod scan after its plan)
        pass
    assert meter.take() == 0.75
    with meter:
        pass
    assert meter.take() == 0.125, "take() starts the next pass's count at zero"
