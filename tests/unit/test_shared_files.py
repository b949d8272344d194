"""Files several processes share (a driver pool, a state directory, atomically replaced records):
many processes released at the same instant, many rounds, and none trips over another's files."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from controller_runtime.clock_testing import FakeClock
from controller_runtime.files import FileLock, is_temp_name, remove_stale_temps, temp_name, write_atomic
from csi_driver.state import DriverState

ROUNDS = 50
PROCESSES = 6


def _race(base: str, index: int, barrier: Barrier, errors: multiprocessing.Queue[str]) -> None:
    """One contender: every round, after the barrier, loads a driver state on the round's shared
    pool (process 0 also takes the controller side) and replaces one shared record."""
    for round_ in range(ROUNDS):
        barrier.wait()
        root = Path(base) / f"round-{round_}"
        state = DriverState(root / "pool", root / f"state-{index}")
        try:

            async def start(s: DriverState = state) -> None:
                await s.load()
                if index == 0:
                    await s.take_controller_side()

            asyncio.run(start())
            doc = {"writer": index, "payload": "x" * 4096}
            write_atomic(root / "pool" / "shared.json", json.dumps(doc).encode())
        except Exception as e:
            errors.put(f"process {index}, round {round_}: {type(e).__name__}: {e}")
        finally:
            state.close()
        barrier.wait()


def test_driver_states_loading_on_one_pool_at_once_never_fail(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")  # no inherited threads or event loops
    barrier = ctx.Barrier(PROCESSES)
    errors: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(tmp_path), i, barrier, errors)) for i in range(PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert [p.exitcode for p in procs] == [0] * PROCESSES and not found, found
    for round_ in range(ROUNDS):
        pool = tmp_path / f"round-{round_}" / "pool"
        doc = json.loads((pool / "shared.json").read_text())  # one writer's whole record
        assert doc["payload"] == "x" * 4096 and 0 <= doc["writer"] < PROCESSES
        left = sorted(p.name for p in pool.iterdir())
        assert left == [
            ".controller.lock",
            "ephemeral",
            "freezes",
            "nodes",
            "shared.json",
            "snapshots",
            "volumes",
        ], left


def test_temp_names_are_unique_and_swept_only_as_temps(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    names = {temp_name(target) for _ in range(100)}
    assert len(names) == 100
    assert all(is_temp_name(os.path.basename(n)) for n in names)
    assert not is_temp_name("record.json") and not is_temp_name(".lock")
    for n in list(names)[:3]:
        Path(n).write_text("{")
    write_atomic(target, b"{}")
    assert remove_stale_temps(tmp_path) and sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]


def test_write_atomic_keeps_the_old_content_when_the_write_fails(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    write_atomic(target, b"old")
    with pytest.raises(TypeError):
        write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["record.json"]
    assert target.stat().st_mode & 0o777 == 0o600


async def test_a_held_lock_makes_the_next_holder_wait_and_says_who_holds_it(tmp_path: Path) -> None:
    clock = FakeClock()
    first, second = FileLock(tmp_path / ".lock"), FileLock(tmp_path / ".lock", clock)
    assert first.try_acquire()
    heard: list[str] = []
    waiter = asyncio.create_task(second.acquire(heard.append, poll=0.01))
    await asyncio.wait_for(clock.until_waiting(), 5)  # tried, heard who holds it, waits to poll
    expected = f"{tmp_path / '.lock'} is held by another process (pid {os.getpid()})"
    assert not waiter.done() and heard == [expected] and clock.waiting() == [0.01]
    await clock.advance(0.01)
    await asyncio.wait_for(clock.until_waiting(), 5)  # polled again, still held: told only once
    assert not waiter.done() and len(heard) == 1
    first.release()
    clock.step(0.01)
    await asyncio.wait_for(waiter, 5)  # the next poll takes it
    assert len(heard) == 1
    second.release()
