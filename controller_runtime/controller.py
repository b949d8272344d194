"""The one shape of every kubeloop controller: workers pop a key and run an idempotent sync.

A sync that raises is retried with the queue's per-key backoff; one that returns normally resets it.
A sync may also return a delay to be called again later for that key (a poll, such as waiting for
a VolumeAttachment to disappear) without counting as a failure.

`ControllerContext` is what a controller is built from (the API client, the informer factory its
caches come from, the event recorder, the clock its queues and backoffs run on);
`InformerController` is the part every controller shares: those four as attributes, `synced` for
/readyz, and `start_informers`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

from .client import ApiClient, WritesStoppedError
from .clock import SYSTEM_CLOCK, Clock
from .debug import FAILURES
from .events import EventRecorder
from .informer import SharedInformerFactory
from .logs import get_logger
from .metrics import Counter
from .workqueue import ShutDown, WorkQueue

log = get_logger("controller")
K = TypeVar("K", bound=Hashable)

SYNC_ERRORS = Counter("kubeloop_sync_errors_total", "Syncs that failed and were requeued", ["queue"])

Sync = Callable[[K], Awaitable[float | None]]


async def worker(queue: WorkQueue[K], sync: Sync[K]) -> None:
    errors = SYNC_ERRORS.labels(queue.name)
    while True:
        try:
            key = await queue.get()
        except ShutDown:
            return
        try:
            again = await sync(key)
        except WritesStoppedError:
            # The process stopped writing (it stands down for kcm's counterpart, which the log and
            # /readyz say): no retry of any key can succeed, so the worker ends without one.
            return
        except Exception as exc:
            errors.inc()
            error = str(exc) or type(exc).__name__
            retries = queue.num_requeues(key)
            log.warning(
                "sync failed, requeued with backoff",
                queue=queue.name,
                key=str(key),
                retries=retries,
                error=error,
            )
            FAILURES.failed(queue.name, str(key), error, retries + 1, queue.add_rate_limited(key))
        else:
            FAILURES.succeeded(queue.name, str(key))
            queue.forget(key)
            if again is not None:
                queue.add_after(key, again)
        finally:
            queue.done(key)
        # A sync that needed no I/O never yielded, and get() returns at once while keys are queued:
        # without this a worker would run a whole backlog (a resync re-queues every object) in one
        # event-loop step, stalling every other worker's in-flight requests until it is through.
        await asyncio.sleep(0)


async def run_workers(queue: WorkQueue[K], sync: Sync[K], workers: int) -> None:
    """Runs `workers` workers until cancelled, then shuts the queue down. A sync cut short by the
    cancellation is simply redone by the next process: syncs are level-triggered and idempotent."""
    tasks = [
        asyncio.create_task(worker(queue, sync), name=f"{queue.name}-worker-{i}") for i in range(workers)
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        queue.shutdown()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


@dataclass(frozen=True)
class ControllerContext:
    """What a controller is built from (kube-controller-manager calls its own ControllerContext):
    serve_controller makes one per leadership term."""

    client: ApiClient
    factory: SharedInformerFactory
    recorder: EventRecorder
    # What the controller's workqueues, rate limiters and backoffs read time from and wait on; a
    # test passes a FakeClock (controller_runtime.clock_testing).
    clock: Clock = SYSTEM_CLOCK


class InformerController:
    """The base of every informer-fed controller: its client, informer factory, recorder and clock
    as attributes, `synced` while every cache is filled, and `start_informers`."""

    def __init__(self, context: ControllerContext) -> None:
        self.client = context.client
        self.factory = context.factory
        self.recorder = context.recorder
        self.clock = context.clock

    @property
    def synced(self) -> bool:
        return self.factory.has_synced

    async def start_informers(self) -> None:
        """Starts the factory's informers and waits until every cache is filled."""
        self.factory.start()
        await asyncio.gather(self.factory.wait_for_sync(), self.client.warm())
