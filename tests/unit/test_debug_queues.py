"""controller_runtime.debug: a failed sync is listed with its error, retries and next attempt until
the key syncs again, through the worker every controller runs."""

from __future__ import annotations

import asyncio

from controller_runtime.clock_testing import FakeClock
from controller_runtime.controller import worker
from controller_runtime.debug import FAILURES
from controller_runtime.workqueue import WorkQueue, default_rate_limiter


async def test_a_failing_key_is_listed_until_it_syncs() -> None:
    clock = FakeClock()
    queue: WorkQueue[str] = WorkQueue("debug-test", default_rate_limiter(clock=clock), clock=clock)
    outcomes = iter([RuntimeError("pool is full"), None])

    async def sync(key: str) -> float | None:
        outcome = next(outcomes)
        if outcome is not None:
            raise outcome
        return None

    queue.add("ns/claim")
    task = asyncio.create_task(worker(queue, sync))
    try:
        await asyncio.wait_for(clock.until_waiting(1), 5)  # the retry's timer: the sync failed
        listed = FAILURES.snapshot()["queues"].get("debug-test")
        assert listed and listed[0]["key"] == "ns/claim" and listed[0]["error"] == "pool is full"
        assert listed[0]["retries"] == 1 and listed[0]["next_retry_in"] >= 0
        await clock.advance(1)  # the rate limiter's first retry is milliseconds away
        await asyncio.wait_for(queue.wait_idle(), 5)
        assert "debug-test" not in FAILURES.snapshot()["queues"]
    finally:
        task.cancel()
        queue.shutdown()
