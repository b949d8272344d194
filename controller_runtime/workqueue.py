"""client-go's workqueue for asyncio.

Guarantees, as in client-go:
- a key added several times before a worker takes it is processed once (the *dirty* set);
- a key being processed is never handed to a second worker; if it is added meanwhile it is queued
  again when the first worker calls `done` (the *processing* set);
- `add_after` delays an add; `add_rate_limited` delays by the rate limiter's verdict for that key
  (per-key exponential backoff combined with an overall token bucket); `forget` resets the key's
  backoff after a successful sync;
- `shutdown` wakes every waiting worker; `get` raises ShutDown once the queue is drained.

Time comes from the injected `Clock` (client-go's delaying queue and rate limiters take one too):
delayed adds are timers on it and the latency metrics are read from it, so a test drives the
queue with a fake clock instead of sleeping.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar

from .clock import SYSTEM_CLOCK, Clock, Timer
from .metrics import Counter, Gauge, Histogram
from .ratelimit import TokenBucket

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)

DEPTH = Gauge("workqueue_depth", "Current depth of the workqueue", ["name"])
ADDS = Counter("workqueue_adds_total", "Adds handled by the workqueue", ["name"])
RETRIES = Counter("workqueue_retries_total", "Rate-limited re-adds handled by the workqueue", ["name"])
_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1, 10, 100)
QUEUE_LATENCY = Histogram(
    "workqueue_queue_duration_seconds",
    "Time a key waits in the queue before a worker takes it",
    ["name"],
    buckets=_BUCKETS,
)
WORK_DURATION = Histogram(
    "workqueue_work_duration_seconds", "Time a worker spends on one key", ["name"], buckets=_BUCKETS
)


class ShutDown(Exception):
    """The queue is shut down and drained."""


class RateLimiter(Protocol[K_contra]):
    def when(self, key: K_contra) -> float: ...
    def forget(self, key: K_contra) -> None: ...
    def num_requeues(self, key: K_contra) -> int: ...


class ItemExponentialRateLimiter(Generic[K]):
    """base * 2^failures per key, capped at `maximum`."""

    def __init__(self, base: float, maximum: float) -> None:
        self.base = base
        self.maximum = maximum
        self._failures: dict[K, int] = {}

    def when(self, key: K) -> float:
        n = self._failures.get(key, 0)
        self._failures[key] = n + 1
        # Guard the exponent: 2**1000 as a float overflows long before the cap matters.
        return self.maximum if n > 62 else min(self.maximum, self.base * (2**n))

    def forget(self, key: K) -> None:
        self._failures.pop(key, None)

    def num_requeues(self, key: K) -> int:
        return self._failures.get(key, 0)


class BucketRateLimiter(Generic[K]):
    """An overall token bucket shared by all keys: bounds the retry rate of the whole queue."""

    def __init__(self, qps: float, burst: int, clock: Clock = SYSTEM_CLOCK) -> None:
        self._bucket = TokenBucket(qps, burst, clock)

    def when(self, key: K) -> float:
        return self._bucket.reserve()

    def forget(self, key: K) -> None:
        pass

    def num_requeues(self, key: K) -> int:
        return 0


class MaxOfRateLimiter(Generic[K]):
    def __init__(self, *limiters: RateLimiter[K]) -> None:
        self.limiters = limiters

    def when(self, key: K) -> float:
        return max(limiter.when(key) for limiter in self.limiters)

    def forget(self, key: K) -> None:
        for limiter in self.limiters:
            limiter.forget(key)

    def num_requeues(self, key: K) -> int:
        return max(limiter.num_requeues(key) for limiter in self.limiters)


def default_rate_limiter(
    base: float = 0.005, maximum: float = 1000.0, clock: Clock = SYSTEM_CLOCK
) -> MaxOfRateLimiter[K]:
    """client-go's DefaultControllerRateLimiter: 5ms doubling to 1000s per key, 10 qps / 100 burst overall."""
    return MaxOfRateLimiter(ItemExponentialRateLimiter(base, maximum), BucketRateLimiter(10.0, 100, clock))


class WorkQueue(Generic[K]):
    def __init__(
        self, name: str, rate_limiter: RateLimiter[K] | None = None, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        """`clock` times the delayed adds and the metrics; the default rate limiter (when none is
        given) reads the same clock."""
        self.name = name
        self.clock = clock
        self.rate_limiter: RateLimiter[K] = rate_limiter or default_rate_limiter(clock=clock)
        self._queue: deque[K] = deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._added_at: dict[K, float] = {}
        self._started_at: dict[K, float] = {}
        self._waiting: dict[K, tuple[float, Timer]] = {}
        self._getters: deque[asyncio.Future[None]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()
        self._shutting_down = False
        self._depth = DEPTH.labels(name)
        self._adds = ADDS.labels(name)
        self._retries = RETRIES.labels(name)
        self._queue_latency = QUEUE_LATENCY.labels(name)
        self._work_duration = WORK_DURATION.labels(name)

    # -- adding ---------------------------------------------------------------------------------

    def add(self, key: K) -> None:
        if self._shutting_down or key in self._dirty:
            return
        self._adds.inc()
        self._dirty.add(key)
        self._added_at.setdefault(key, self.clock.monotonic())
        if key in self._processing:
            return  # queued again by done()
        self._push(key)

    def _push(self, key: K) -> None:
        self._queue.append(key)
        self._depth.set(len(self._queue))
        self._idle.clear()
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                break

    def add_after(self, key: K, delay: float) -> None:
        """Adds the key after `delay` seconds; a later request for an already-waiting key keeps the
        earlier time."""
        if self._shutting_down:
            return
        if delay <= 0:
            self.add(key)
            return
        ready = self.clock.monotonic() + delay
        current = self._waiting.get(key)
        if current is not None:
            if current[0] <= ready:
                return
            current[1].cancel()
        self._idle.clear()
        self._waiting[key] = (ready, self.clock.call_later(delay, self._fire, key))

    def _fire(self, key: K) -> None:
        self._waiting.pop(key, None)
        self.add(key)
        self._check_idle()

    def add_rate_limited(self, key: K) -> float:
        """Adds `key` after its rate limiter's delay; returns the delay."""
        self._retries.inc()
        delay = self.rate_limiter.when(key)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        self.rate_limiter.forget(key)

    def num_requeues(self, key: K) -> int:
        return self.rate_limiter.num_requeues(key)

    # -- taking ---------------------------------------------------------------------------------

    async def get(self) -> K:
        while not self._queue:
            if self._shutting_down:
                raise ShutDown(self.name)
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except asyncio.CancelledError:
                # Hand our wake-up to another waiter so an add is not lost.
                if getter.done() and not getter.cancelled() and self._queue:
                    self._push_wakeup()
                raise
        key = self._queue.popleft()
        self._depth.set(len(self._queue))
        self._dirty.discard(key)
        self._processing.add(key)
        now = self.clock.monotonic()
        added = self._added_at.pop(key, None)
        if added is not None:
            self._queue_latency.observe(now - added)
        self._started_at[key] = now
        return key

    def _push_wakeup(self) -> None:
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return

    def done(self, key: K) -> None:
        self._processing.discard(key)
        started = self._started_at.pop(key, None)
        if started is not None:
            self._work_duration.observe(self.clock.monotonic() - started)
        if key in self._dirty:
            self._push(key)
        self._check_idle()

    def _check_idle(self) -> None:
        if not self._queue and not self._processing and not self._waiting:
            self._idle.set()

    # -- state and shutdown ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def processing(self) -> frozenset[K]:
        return frozenset(self._processing)

    async def wait_idle(self) -> None:
        """Waits until nothing is queued, waiting for a delay, or being processed (tests, benches)."""
        await self._idle.wait()

    def shutdown(self) -> None:
        self._shutting_down = True
        for _, handle in self._waiting.values():
            handle.cancel()
        self._waiting.clear()
        while self._getters:
            getter = self._getters.popleft()
            if not getter.done():
                getter.set_result(None)
