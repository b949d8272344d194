"""client-go workqueue semantics, on the asyncio queue."""

from __future__ import annotations

import asyncio

import pytest

from controller_runtime.workqueue import (
    BucketRateLimiter,
    ItemExponentialRateLimiter,
    MaxOfRateLimiter,
    ShutDown,
    WorkQueue,
    default_rate_limiter,
)


def fast_queue(name: str) -> WorkQueue[str]:
    return WorkQueue(name, ItemExponentialRateLimiter[str](0.01, 0.08))


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
    await asyncio.sleep(0.01)
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
    limiter = MaxOfRateLimiter[str](ItemExponentialRateLimiter(0.001, 1), BucketRateLimiter(10, 5))
    delays = [limiter.when(f"k{i}") for i in range(8)]
    assert delays[:5] == [0.001] * 5, "the burst passes at the per-key delay"
    assert delays[5] == pytest.approx(0.1, abs=0.02), "then keys wait for the shared bucket"
    assert delays[7] > delays[6] > delays[5]


async def test_add_rate_limited_delays_and_forget_resets() -> None:
    q = fast_queue("ratelimited")
    loop = asyncio.get_running_loop()
    q.add_rate_limited("a")
    q.add_rate_limited("a")  # a second request for a waiting key keeps the earlier time
    start = loop.time()
    assert await asyncio.wait_for(q.get(), 1) == "a"
    assert loop.time() - start >= 0.009
    q.done("a")
    assert q.num_requeues("a") == 2
    q.forget("a")
    assert q.num_requeues("a") == 0


async def test_add_after_keeps_earliest_time() -> None:
    q = fast_queue("after")
    q.add_after("a", 5)
    q.add_after("a", 0.01)
    assert await asyncio.wait_for(q.get(), 1) == "a"


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
    q = fast_queue("idle")
    q.add_after("a", 0.01)
    idle = asyncio.create_task(q.wait_idle())
    key = await q.get()
    await asyncio.sleep(0)
    assert not idle.done()
    q.done(key)
    await asyncio.wait_for(idle, 1)


def test_default_rate_limiter_is_client_go_default() -> None:
    limiter: MaxOfRateLimiter[str] = default_rate_limiter()
    assert limiter.when("k") == 0.005
