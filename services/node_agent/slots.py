"""A bounded number of volume operations at once, handed out by priority, then in arrival order."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator

# Lower runs first. Unstaging finishes a volume that is already unpublished (its detach waits for
# nothing else), so it goes ahead of starting on another volume.
UNSTAGE = 0
UNPUBLISH = 1
MOUNT = 1


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
