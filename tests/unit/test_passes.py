"""PassPacer: when a level-triggered loop starts its next pass (fake clock and sleep: no waiting)."""

from __future__ import annotations

import asyncio

from controller_runtime.passes import CpuMeter, PassPacer


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


def pacer(t: FakeTime) -> tuple[PassPacer, asyncio.Event]:
    wake = asyncio.Event()
    return PassPacer(wake, period=0.1, floor=0.01, clock=t.clock, sleep=t.sleep), wake


async def test_an_event_after_a_quiet_spell_starts_a_pass_at_once() -> None:
    t = FakeTime()
    p, wake = pacer(t)
    p.pass_ended(cpu_spent=0.001)
    t.now += 5.0  # quiet
    wake.set()
    await p.next_pass()
    assert t.slept == []
    assert not wake.is_set(), "cleared for the events of the pass that starts now"


async def test_events_right_after_a_pass_wait_for_the_floor() -> None:
    t = FakeTime()
    p, wake = pacer(t)
    p.pass_ended(cpu_spent=0.001)
    t.now += 0.004
    wake.set()
    await p.next_pass()
    assert t.slept == [0.006]


async def test_a_pass_that_spent_more_cpu_than_the_floor_is_followed_by_as_long_a_rest() -> None:
    t = FakeTime()
    p, wake = pacer(t)
    p.pass_ended(cpu_spent=0.05)
    wake.set()
    await p.next_pass()
    assert t.slept == [0.05]


async def test_an_event_during_the_rest_is_left_for_the_pass_that_follows_it() -> None:
    t = FakeTime()
    p, wake = pacer(t)
    p.pass_ended(cpu_spent=0.0)
    wake.set()

    async def event_while_resting(seconds: float) -> None:
        await FakeTime.sleep(t, seconds)
        wake.set()

    p.sleep = event_while_resting
    await p.next_pass()
    assert not wake.is_set(), "the pass about to start sees that event's state already"


def test_cpu_meter_sums_the_deciding_blocks_of_one_pass() -> None:
    readings = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125])
    meter = CpuMeter(clock=lambda: next(readings))
    with meter:
        pass
    with meter:  # a second block of the same pass (the node agent's pod scan after its plan)
        pass
    assert meter.take() == 0.75
    with meter:
        pass
    assert meter.take() == 0.125, "take() starts the next pass's count at zero"
