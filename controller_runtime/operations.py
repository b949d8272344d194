"""One operation at a time per key, exponential backoff per operation: Kubernetes'
nestedpendingoperations and exponentialbackoff for asyncio.

A controller's reconcile pass decides what should happen to each volume (attach, detach, mount,
unstage...) and hands each decision to the executor under the volume's key:

    ops = OperationExecutor[str]("attachdetach", on_done=wake.set)
    ...
    if not ops.is_pending(va_name):
        ops.run(va_name, self._attach(entry))

- At most one operation per key is in flight (queued for a slot or running); `run` refuses a
  second one, so a pass can never start an operation twice on the same volume.
- An operation that raises is backed off: the same (key, operation) is pending, and refused, for
  `initial` seconds, then twice as long after each further failure, up to `max` (500 ms doubling to
  2m2s, as Kubernetes). Success forgets the backoff. An operation that raises `RetryLater` (a
  precondition not met yet) is retried after `initial` without growing the backoff or a warning.
- Optionally at most `max_concurrent` operations run at once (0 = no limit, Kubernetes'
  behaviour); waiting ones start by `priority` (lower first), then in the order they were run.
- `pending_operations{name}` counts the operations in flight.
- Time comes from the injected clock (`controller_runtime.clock`), so backoff is testable
  without sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .clock import SYSTEM_CLOCK, PassiveClock
from .logs import Logger, get_logger
from .metrics import Gauge

K = TypeVar("K", bound=Hashable)

PENDING = Gauge(
    "pending_operations",
    "Operations in flight (queued for a slot or running), at most one per key",
    ["name"],
)


class RetryLater(Exception):
    """Raised by an operation whose precondition is not met yet (not attached, plugin not
    registered): retried after the initial delay, without growing the backoff or a warning."""


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: `initial` after the first failure, doubling, at most `max`."""

    initial: float = 0.5
    max: float = 122.0

    def next(self, last: float) -> float:
        return min(self.max, max(self.initial, last * 2))


class OperationSlots:
    """At most `limit` holders (0 = no limit). A waiter with a lower priority number is served
    first; equal priorities in the order they asked. Cancelling a waiter gives up its place."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.busy = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrival = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    @contextlib.asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        if self.limit <= 0:
            yield
            return
        if self.busy < self.limit and not self.waiting:
            self.busy += 1
        else:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            heapq.heappush(self._waiters, (priority, next(self._arrival), fut))
            try:
                await fut  # the releaser hands its slot over: busy already counts this holder
            except asyncio.CancelledError:
                if fut.done() and not fut.cancelled():
                    self._release()  # handed a slot, then cancelled before using it
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)
                return
        self.busy -= 1


class OperationExecutor(Generic[K]):
    """Runs operations keyed by volume: one in flight per key, backoff per (key, operation)."""

    def __init__(
        self,
        name: str,
        *,
        backoff: Backoff | None = None,
        max_concurrent: int = 0,
        clock: PassiveClock = SYSTEM_CLOCK,
        on_done: Callable[[], None] | None = None,
        describe_error: Callable[[BaseException], str] = str,
        logger: Logger | None = None,
    ) -> None:
        """`on_done` is called after every operation ends (to wake the reconcile loop);
        `describe_error` turns a failure into the logged message."""
        self.name = name
        self.backoff = backoff or Backoff()
        self.slots = OperationSlots(max_concurrent)
        self.clock = clock
        self._on_done = on_done
        self._describe = describe_error
        self._log = logger or get_logger(f"operations.{name}")
        self._running: dict[K, asyncio.Task[None]] = {}
        self._retry: dict[tuple[K, Hashable], tuple[float, float]] = {}  # -> (retry at, last delay)
        self._pending = PENDING.labels(name)

    # -- asking -------------------------------------------------------------------------------------

    def in_flight(self, key: K) -> bool:
        """Whether an operation on `key` is queued or running."""
        return key in self._running

    def is_pending(self, key: K, operation: Hashable = None) -> bool:
        """Whether `run(key, ..., operation=operation)` would be refused now: an operation on
        `key` is in flight, or this operation failed and its backoff has not expired."""
        if key in self._running:
            return True
        retry = self._retry.get((key, operation))
        return retry is not None and self.clock.monotonic() < retry[0]

    def retry_delay(self, key: K, operation: Hashable = None) -> float:
        """The delay the last failure of this operation got (0 when it has not failed)."""
        return self._retry.get((key, operation), (0.0, 0.0))[1]

    def __len__(self) -> int:
        return len(self._running)

    # -- running ------------------------------------------------------------------------------------

    def run(
        self,
        key: K,
        coro: Coroutine[Any, Any, None],
        *,
        operation: Hashable = None,
        priority: int = 0,
    ) -> bool:
        """Starts `coro` as the operation on `key`, unless `is_pending(key, operation)`: then
        `coro` is closed unrun and False returned. `operation` names what is done to the key
        (e.g. ("mount", pod)) when different operations on it back off separately."""
        if self.is_pending(key, operation):
            coro.close()
            return False
        self._pending.inc()
        self._running[key] = asyncio.create_task(
            self._execute(key, operation, coro, priority), name=f"{self.name}:{key}"
        )
        return True

    async def _execute(
        self, key: K, operation: Hashable, coro: Coroutine[Any, Any, None], priority: int
    ) -> None:
        retry_key = (key, operation)
        try:
            async with self.slots.hold(priority):
                await coro
        except RetryLater as exc:
            self._log.debug("waiting", key=str(key), reason=str(exc))
            self._retry[retry_key] = (self.clock.monotonic() + self.backoff.initial, 0.0)
        except Exception as exc:
            _, last = self._retry.get(retry_key, (0.0, 0.0))
            delay = self.backoff.next(last)
            self._retry[retry_key] = (self.clock.monotonic() + delay, delay)
            self._log.warning(
                "operation failed, backing off",
                key=str(key),
                operation=str(operation) if operation is not None else "",
                delay=f"{delay:.1f}s",
                error=self._describe(exc),
            )
        else:
            self._retry.pop(retry_key, None)
        finally:
            coro.close()  # never started (cancelled while waiting for a slot): no warning
            self._running.pop(key, None)
            self._pending.dec()
            if self._on_done is not None:
                self._on_done()

    def forget(self, keep: Collection[K]) -> None:
        """Drops the backoff of every key not in `keep` (volumes that are gone)."""
        for retry_key in [k for k in self._retry if k[0] not in keep]:
            del self._retry[retry_key]

    async def wait(self) -> None:
        """Returns once no operation is in flight (including ones started meanwhile)."""
        while self._running:
            await asyncio.gather(*list(self._running.values()), return_exceptions=True)

    async def shutdown(self) -> None:
        """Cancels every operation in flight and waits for them to end."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
