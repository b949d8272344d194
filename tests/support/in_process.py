"""Components a test runs in its own event loop: `stop` cancels their tasks, waits for each to end,
then closes what they opened (CSI connections, event recorders, informer factories, API
clients), in the order given."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence


async def stop(tasks: Sequence[asyncio.Task[None]], closers: Sequence[Callable[[], Awaitable[None]]]) -> None:
    for task in tasks:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    for close in closers:
        await close()
