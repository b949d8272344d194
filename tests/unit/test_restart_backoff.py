"""The stack's restart supervision (localstack.proc.RestartPolicy): the backoff series, and
ManagedProcess restarting a real crashing child, its backoff waits stepped on a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from controller_runtime.clock_testing import FakeClock
from localstack.proc import ManagedProcess, RestartBackoff, RestartEvent, RestartPolicy


@contextlib.asynccontextmanager
async def waits_stepped(clock: FakeClock) -> AsyncIterator[list[float]]:
    """Ends each wait on `clock` as soon as it begins, recording its length: the restart backoff
    passes at once (the children themselves still run and crash in real time)."""
    waits: list[float] = []

    async def step() -> None:
        while True:
            await clock.until_waiting()
            (delay,) = clock.waiting()
            waits.append(delay)
            clock.step(delay)

    stepper = asyncio.create_task(step())
    try:
        yield waits
    finally:
        stepper.cancel()
        await asyncio.gather(stepper, return_exceptions=True)


def test_delays_double_up_to_the_cap() -> None:
    backoff = RestartBackoff(RestartPolicy(initial=1, factor=2, cap=30, reset_after=60))
    now = 0.0
    delays = []
    for _ in range(8):
        backoff.started(now)
        now += 1  # crashes a second after each start
        attempt, delay = backoff.crashed(now)
        delays.append((attempt, delay))
        now += delay
    assert delays == [(1, 1), (2, 2), (3, 4), (4, 8), (5, 16), (6, 30), (7, 30), (8, 30)]
    assert backoff.total == 8
    assert backoff.next_delay() == 30


def test_a_long_enough_run_resets_the_series() -> None:
    backoff = RestartBackoff(RestartPolicy(initial=1, factor=2, cap=30, reset_after=60))
    backoff.started(0)
    assert backoff.crashed(5) == (1, 1)
    backoff.started(6)
    assert backoff.crashed(10) == (2, 2)
    backoff.started(12)
    assert backoff.crashed(12 + 59.9) == (3, 4), "59.9 s up is not long enough"
    backoff.started(100)
    assert backoff.crashed(160) == (1, 1), "60 s up starts the series again"
    assert backoff.total == 4, "the total keeps counting"


def _crasher(code: int = 3) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


async def test_a_crashing_process_is_restarted_with_backoff(tmp_path: Path) -> None:
    clock = FakeClock()
    events: list[RestartEvent] = []
    reported: list[int] = []
    enough = asyncio.Event()

    def restarting(_p: ManagedProcess, e: RestartEvent) -> None:
        events.append(e)
        if len(events) >= 10:
            enough.set()

    proc = ManagedProcess(
        name="crasher",
        argv=_crasher(),
        log_path=tmp_path / "crasher.log",
        restart=RestartPolicy(initial=1, cap=8),
        on_restart=restarting,
        on_unexpected_exit=lambda _p, code: reported.append(code),
        clock=clock,
    )
    async with waits_stepped(clock) as waited:
        await proc.start()
        await asyncio.wait_for(enough.wait(), 30)
        await proc.stop(5)
    assert not reported, "a supervised crash is restarted, not only reported"
    waits = [e for e in events if not e.restarted]
    done = [e for e in events if e.restarted]
    assert [e.backoff for e in waits[:5]] == [1, 2, 4, 8, 8]
    assert [e.attempt for e in done[:5]] == [1, 2, 3, 4, 5]
    assert [e.backoff for e in done[:4]] == [2, 4, 8, 8], "the wait the next crash would get"
    assert all(e.exit_code == 3 for e in events)
    assert all(e.pid is not None for e in done)
    assert waited[:5] == [1, 2, 4, 8, 8], "the backoff waited on the clock, not in real time"
    assert tmp_path.joinpath("crasher.log").read_text().count("kubeloop starts") == proc.restarts + 1


async def test_stop_during_the_backoff_calls_the_restart_off(tmp_path: Path) -> None:
    clock = FakeClock()  # the backoff wait ends only when the clock is stepped
    proc = ManagedProcess(
        name="crasher",
        argv=_crasher(),
        log_path=tmp_path / "crasher.log",
        restart=RestartPolicy(),
        clock=clock,
    )
    await proc.start()
    await asyncio.wait_for(clock.until_waiting(), 20)
    assert await proc.stop(5) == 3
    assert not clock.has_waiters(), "the backoff wait is called off"
    await clock.advance(3600)
    assert not proc.running and proc.restarts == 1
    assert tmp_path.joinpath("crasher.log").read_text().count("kubeloop starts") == 1, "not started again"


async def test_stop_is_not_a_crash(tmp_path: Path) -> None:
    events: list[RestartEvent] = []
    proc = ManagedProcess(
        name="sleeper",
        argv=[sys.executable, "-c", "import signal; signal.pause()"],
        log_path=tmp_path / "sleeper.log",
        restart=RestartPolicy(),
        on_restart=lambda _p, e: events.append(e),
        clock=(clock := FakeClock()),
    )
    await proc.start()
    assert await proc.stop(5) == -15  # SIGTERM
    assert not clock.has_waiters(), "no restart backoff"
    await clock.advance(3600)
    assert not events and proc.restarts == 0 and not proc.running
