"""client-go workqueue semantics, on the asyncio queue, with delays on a fake clock."""

from __future__ import annotations

import asyncio

import pytest

from controller_runtime.clock_testing import FakeClock
from controller_runtime.metrics import REGISTRY
from controller_runtime.workqueue import (
    BucketRateLimiter,
    ItemExponentialRateLimiter,
    MaxOfRateLimiter,
    ShutDown,
    WorkQueue,
    default_rate_limiter,
)


def fast_queue(name: str, clock: FakeClock | None = None) -> WorkQueue[str]:
    return WorkQueue(name, ItemExponentialRateLimiter[str](0.01, 0.08), clock=clock or FakeClock())


async def test_key_added_twice_is_processed_once() -> None:
    q = fast_queue("dedupe")
    q.add("a")
    q.add("a")
    q.add("b")
    assert len(q) == 2
    assert await q.get() == "a"
    assert await q.get() == "b"
    assert len(q) == 0


async def test_key_in_processing_is_not_handed_out_again_until_done() -> None:
    q = fast_queue("processing")
    q.add("a")
    key = await q.get()
    q.add("a")  # re-added while a worker holds it
    assert len(q) == 0, "must not be queued while processing"
    second = asyncio.create_task(q.get())
    await FakeClock().settle()  # the second worker runs until it waits
    assert not second.done(), "a second worker must not get a key that is being processed"
    q.done(key)
    assert await asyncio.wait_for(second, 1) == "a", "re-added key is processed again after done"
    q.done("a")
    assert len(q) == 0


async def test_done_without_readd_does_not_requeue() -> None:
    q = fast_queue("done")
    q.add("a")
    q.done(await q.get())
    assert len(q) == 0
    assert q.processing == frozenset()


async def test_waiting_getter_wakes_on_add() -> None:
    q = fast_queue("wake")
    getter = asyncio.create_task(q.get())
    await asyncio.sleep(0)
    q.add("x")
    assert await asyncio.wait_for(getter, 1) == "x"


def test_exponential_backoff_grows_caps_and_forgets() -> None:
    limiter = ItemExponentialRateLimiter[str](0.005, 0.1)
    delays = [limiter.when("k") for _ in range(7)]
    assert delays[:5] == [0.005, 0.01, 0.02, 0.04, 0.08]
    assert delays[5:] == [0.1, 0.1]
    assert limiter.num_requeues("k") == 7
    assert limiter.when("other") == 0.005, "backoff is per key"
    limiter.forget("k")
    assert limiter.num_requeues("k") == 0
    assert limiter.when("k") == 0.005
    assert ItemExponentialRateLimiter[str](1, 1000).when("k") == 1


def test_huge_failure_count_does_not_overflow() -> None:
    limiter = ItemExponentialRateLimiter[str](0.005, 1000)
    for _ in range(2000):
        delay = limiter.when("k")
    assert delay == 1000


def test_overall_bucket_limits_many_keys() -> None:
    clock = FakeClock()
    limiter = MaxOfRateLimiter[str](ItemExponentialRateLimiter(0.001, 1), BucketRateLimiter(10, 5, clock))
    delays = [limiter.when(f"k{i}") for i in range(8)]
    assert delays[:5] == [0.001] * 5, "the burst passes at the per-key delay"
    assert delays[5] == pytest.approx(0.1), "then keys wait for the shared bucket"
    assert delays[7] > delays[6] > delays[5]
    clock.step(1.0)  # the bucket refills on its clock, 10 tokens a second, up to its burst
    assert [limiter.when(f"k{i}") for i in range(8, 13)] == [0.001] * 5
    assert limiter.when("k13") == pytest.approx(0.1)


async def test_add_rate_limited_delays_and_forget_resets() -> None:
    clock = FakeClock()
    q = fast_queue("ratelimited", clock)
    q.add_rate_limited("a")
    q.add_rate_limited("a")  # a second request for a waiting key keeps the earlier time
    assert clock.waiting() == [0.01]
    getter = asyncio.create_task(q.get())
    await clock.advance(0.009)
    assert not getter.done(), "not before the backoff's delay"
    await clock.advance(0.001)
    assert getter.done() and getter.result() == "a"
    assert not clock.has_waiters()
    q.done("a")
    assert q.num_requeues("a") == 2
    q.forget("a")
    assert q.num_requeues("a") == 0


async def test_add_after_keeps_earliest_time() -> None:
    clock = FakeClock()
    q = fast_queue("after", clock)
    q.add_after("a", 5)
    q.add_after("a", 0.01)
    q.add_after("a", 1)
    assert clock.waiting() == [0.01], "the later timer is cancelled, a later request ignored"
    clock.step(0.01)
    assert await q.get() == "a"
    assert not clock.has_waiters()


async def test_delayed_adds_fire_in_the_order_of_their_deadlines() -> None:
    clock = FakeClock()
    q = fast_queue("order", clock)
    for key, delay in (("c", 3), ("a", 1), ("b", 2), ("d", 3)):
        q.add_after(key, delay)
    clock.step(2.5)
    assert len(q) == 2 and [await q.get(), await q.get()] == ["a", "b"]
    clock.step(0.5)
    assert [await q.get(), await q.get()] == ["c", "d"], "equal deadlines in the order added"


async def test_shutdown_wakes_waiters_and_drains() -> None:
    q = fast_queue("shutdown")
    waiters = [asyncio.create_task(q.get()) for _ in range(3)]
    await asyncio.sleep(0)
    q.shutdown()
    for w in waiters:
        with pytest.raises(ShutDown):
            await asyncio.wait_for(w, 1)
    q.add("late")
    assert len(q) == 0, "adds after shutdown are ignored"


async def test_shutdown_lets_queued_keys_drain_first() -> None:
    q = fast_queue("drain")
    q.add("a")
    q.add_after("b", 10)
    q.shutdown()
    assert await q.get() == "a"
    with pytest.raises(ShutDown):
        await q.get()


async def test_wait_idle() -> None:
    clock = FakeClock()
    q = fast_queue("idle", clock)
    q.add_after("a", 0.01)
    idle = asyncio.create_task(q.wait_idle())
    getter = asyncio.create_task(q.get())
    await clock.settle()
    assert not idle.done(), "a key waiting for its delay keeps the queue busy"
    await clock.advance(0.01)
    key = await getter
    await clock.settle()
    assert not idle.done()
    q.done(key)
    await asyncio.wait_for(idle, 1)


async def test_latency_metrics_are_read_from_the_queue_clock() -> None:
    clock = FakeClock()
    q = fast_queue("metrics", clock)

    def seconds(metric: str) -> float | None:
        return REGISTRY.get_sample_value(f"workqueue_{metric}_duration_seconds_sum", {"name": "metrics"})

    q.add("a")
    clock.step(2.5)
    key = await q.get()
    clock.step(0.25)
    q.done(key)
    assert (seconds("queue"), seconds("work")) == (2.5, 0.25)


def test_default_rate_limiter_is_client_go_default() -> None:
    limiter: MaxOfRateLimiter[str] = default_rate_limiter()
    assert limiter.when("k") == 0.005
