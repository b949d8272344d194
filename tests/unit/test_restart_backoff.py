"""The stack's restart supervision (localstack.proc.RestartPolicy): the backoff series on a fake
clock, and ManagedProcess restarting a real crashing child with the fake clock's instant sleeps."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from localstack.proc import ManagedProcess, RestartBackoff, RestartEvent, RestartPolicy


class FakeClock:
    """Monotonic time that only moves when told to, or by the length of each sleep."""

    def __init__(self) -> None:
        self.now = 500.0
        self.sleeps: list[float] = []
        self.gate: asyncio.Event | None = None  # when set up, sleeps block until it is set
        self.slept = asyncio.Event()

    def monotonic(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.slept.set()
        if self.gate is not None:
            await self.gate.wait()
        self.now += seconds
        await asyncio.sleep(0)


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
    assert clock.sleeps[:5] == [1, 2, 4, 8, 8], "nothing really slept"
    assert tmp_path.joinpath("crasher.log").read_text().count("kubeloop starts") == proc.restarts + 1


async def test_stop_during_the_backoff_calls_the_restart_off(tmp_path: Path) -> None:
    clock = FakeClock()
    clock.gate = asyncio.Event()  # the backoff wait never ends by itself
    proc = ManagedProcess(
        name="crasher",
        argv=_crasher(),
        log_path=tmp_path / "crasher.log",
        restart=RestartPolicy(),
        clock=clock,
    )
    await proc.start()
    await asyncio.wait_for(clock.slept.wait(), 20)
    assert await proc.stop(5) == 3
    clock.gate.set()
    await asyncio.sleep(0.1)
    assert not proc.running and proc.restarts == 1
    assert tmp_path.joinpath("crasher.log").read_text().count("kubeloop starts") == 1, "not started again"


async def test_stop_is_not_a_crash(tmp_path: Path) -> None:
    events: list[RestartEvent] = []
    proc = ManagedProcess(
        name="sleeper",
        argv=[sys.executable, "-c", "import time; time.sleep(60)"],
        log_path=tmp_path / "sleeper.log",
        restart=RestartPolicy(),
        on_restart=lambda _p, e: events.append(e),
        clock=FakeClock(),
    )
    await proc.start()
    assert await proc.stop(5) == -15  # SIGTERM
    await asyncio.sleep(0.1)
    assert not events and proc.restarts == 0 and not proc.running
