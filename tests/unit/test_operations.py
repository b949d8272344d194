"""The operation executor: one operation per key, per-operation exponential backoff on a fake
clock, RetryLater, the concurrency limit and its order, the pending gauge, shutdown."""

from __future__ import annotations

import asyncio

from controller_runtime.clock_testing import FakeClock
from controller_runtime.metrics import REGISTRY
from controller_runtime.operations import Backoff, OperationExecutor, RetryLater


def gauge(name: str) -> float | None:
    return REGISTRY.get_sample_value("pending_operations", {"name": name})


async def test_one_operation_per_key_and_other_keys_in_parallel() -> None:
    ops = OperationExecutor[str]("test-per-key")
    gate = asyncio.Event()
    started: list[str] = []

    async def op(name: str) -> None:
        started.append(name)
        await gate.wait()

    assert ops.run("v1", op("first"))
    assert not ops.run("v1", op("second")), "a second operation on a busy key is refused"
    assert ops.run("v2", op("other"))
    assert ops.in_flight("v1") and ops.is_pending("v1") and len(ops) == 2
    assert gauge("test-per-key") == 2
    await asyncio.sleep(0)
    assert started == ["first", "other"]
    gate.set()
    await ops.wait()
    assert not ops.in_flight("v1") and not ops.is_pending("v1") and len(ops) == 0
    assert gauge("test-per-key") == 0
    assert ops.run("v1", op("third")), "free again once the first ended"
    await ops.wait()
    assert started == ["first", "other", "third"]


async def test_failures_back_off_exponentially_up_to_the_max_and_success_resets() -> None:
    clock = FakeClock()
    done: list[int] = []
    ops = OperationExecutor[str](
        "test-backoff", backoff=Backoff(0.5, 2.0), clock=clock, on_done=lambda: done.append(1)
    )

    async def fail() -> None:
        raise RuntimeError("boom")

    async def succeed() -> None:
        pass

    delays = []
    for _ in range(5):
        assert ops.run("v1", fail())
        await ops.wait()
        delays.append(ops.retry_delay("v1"))
        assert ops.is_pending("v1"), "backing off"
        assert not ops.run("v1", succeed()), "refused while backing off"
        clock.step(delays[-1] - 0.01)
        assert ops.is_pending("v1")
        clock.step(0.01)
        assert not ops.is_pending("v1"), "the backoff expired"
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0]
    assert len(done) == 5, "on_done after every operation"
    assert ops.run("v1", succeed())
    await ops.wait()
    assert ops.retry_delay("v1") == 0.0 and not ops.is_pending("v1")
    assert ops.run("v1", fail())
    await ops.wait()
    assert ops.retry_delay("v1") == 0.5, "after a success the backoff starts over"


async def test_default_backoff_is_kubernetes_500ms_doubling_to_2m2s() -> None:
    assert Backoff() == Backoff(0.5, 122.0)
    b = Backoff()
    delays, last = [], 0.0
    for _ in range(10):
        last = b.next(last)
        delays.append(last)
    assert delays == [0.5, 1, 2, 4, 8, 16, 32, 64, 122, 122]


async def test_operations_on_one_key_back_off_separately() -> None:
    clock = FakeClock()
    ops = OperationExecutor[str]("test-per-operation", clock=clock)

    async def fail() -> None:
        raise RuntimeError("boom")

    async def succeed() -> None:
        pass

    ops.run("v1", fail(), operation="mount")
    await ops.wait()
    assert ops.is_pending("v1", "mount")
    assert not ops.is_pending("v1", "unstage")
    assert ops.run("v1", succeed(), operation="unstage")
    await ops.wait()
    assert ops.is_pending("v1", "mount"), "another operation's success leaves this backoff alone"


async def test_retry_later_waits_the_initial_delay_without_growing_the_backoff() -> None:
    clock = FakeClock()
    ops = OperationExecutor[str]("test-retry-later", clock=clock)

    async def fail() -> None:
        raise RuntimeError("boom")

    async def not_yet() -> None:
        raise RetryLater("not attached yet")

    for _ in range(3):
        ops.run("v1", fail())
        await ops.wait()
        clock.step(100)
    assert ops.retry_delay("v1") == 2.0
    ops.run("v1", not_yet())
    await ops.wait()
    assert ops.is_pending("v1")
    clock.step(0.5)
    assert not ops.is_pending("v1")
    assert ops.retry_delay("v1") == 0.0, "a wait resets the backoff"
    ops.run("v1", fail())
    await ops.wait()
    assert ops.retry_delay("v1") == 0.5


async def test_forget_drops_the_backoff_of_keys_that_are_gone() -> None:
    clock = FakeClock()
    ops = OperationExecutor[str]("test-forget", clock=clock)

    async def fail() -> None:
        raise RuntimeError("boom")

    ops.run("gone", fail())
    ops.run("kept", fail())
    await ops.wait()
    ops.forget({"kept"})
    assert not ops.is_pending("gone") and ops.is_pending("kept")


async def test_limit_runs_by_priority_then_in_queue_order() -> None:
    ops = OperationExecutor[str]("test-limit", max_concurrent=2)
    gate = asyncio.Event()
    running: set[str] = set()
    started: list[str] = []
    peak = 0

    async def op(name: str) -> None:
        nonlocal peak
        started.append(name)
        running.add(name)
        peak = max(peak, len(running))
        await gate.wait()
        running.discard(name)

    for i in range(4):
        ops.run(f"v{i}", op(f"v{i}"), priority=1)
    ops.run("urgent", op("urgent"), priority=0)
    assert ops.in_flight("v3"), "a queued operation holds its key"
    await asyncio.sleep(0)
    gate.set()
    await ops.wait()
    assert peak == 2
    assert started == ["v0", "v1", "urgent", "v2", "v3"]


async def test_shutdown_cancels_running_and_queued_operations() -> None:
    ops = OperationExecutor[str]("test-shutdown", max_concurrent=1)
    cancelled: list[str] = []

    async def op(name: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    ops.run("v1", op("v1"))
    ops.run("v2", op("v2"))  # waits for the slot: never starts, closed without a warning
    await asyncio.sleep(0)
    await ops.shutdown()
    assert cancelled == ["v1"]
    assert len(ops) == 0 and ops.slots.busy == 0 and gauge("test-shutdown") == 0
