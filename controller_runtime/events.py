"""core/v1 Event recorder with client-go's aggregation of repeats.

`record` never blocks the caller: events go through a bounded queue to a background writer. The
same (object, type, reason, message, source) seen again within the cache's lifetime increments the
existing Event's `count` and `lastTimestamp` with a PATCH instead of creating a new Event, which is
what `kubectl describe` shows as "(x5 over 2m)".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass

from .client import ApiClient, ApiError, WritesStoppedError
from .clock import now_rfc3339
from .logs import get_logger
from .resources import EVENTS, Obj

log = get_logger("events")

NORMAL = "Normal"
WARNING = "Warning"


def object_reference(obj: Obj, kind: str = "", api_version: str = "") -> Obj:
    md = obj.get("metadata", {})
    ref = {
        "kind": obj.get("kind") or kind,
        "apiVersion": obj.get("apiVersion") or api_version,
        "name": md.get("name", ""),
        "uid": md.get("uid", ""),
        "resourceVersion": md.get("resourceVersion", ""),
    }
    if md.get("namespace"):
        ref["namespace"] = md["namespace"]
    return {k: v for k, v in ref.items() if v}


@dataclass
class Aggregate:
    name: str
    namespace: str
    count: int
    first_timestamp: str


class EventCorrelator:
    """Remembers the last Events written (LRU) so repeats become count updates."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[tuple[str, ...], Aggregate] = OrderedDict()

    @staticmethod
    def key(event: Obj) -> tuple[str, ...]:
        ref = event["involvedObject"]
        src = event.get("source", {})
        return (
            ref.get("kind", ""),
            ref.get("namespace", ""),
            ref.get("name", ""),
            ref.get("uid", ""),
            src.get("component", ""),
            src.get("host", ""),
            event["type"],
            event["reason"],
            event["message"],
        )

    def observe(self, event: Obj) -> Aggregate | None:
        """Returns the earlier Event this one repeats (with its count already raised), or None."""
        key = self.key(event)
        agg = self._seen.get(key)
        if agg is None:
            return None
        agg.count += 1
        self._seen.move_to_end(key)
        return agg

    def remember(self, event: Obj) -> None:
        md = event["metadata"]
        self._seen[self.key(event)] = Aggregate(
            md["name"], md["namespace"], int(event.get("count", 1)), event.get("firstTimestamp", "")
        )
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def forget(self, event: Obj) -> None:
        self._seen.pop(self.key(event), None)


class EventRecorder:
    def __init__(
        self, client: ApiClient, component: str, host: str | None = None, queue_size: int = 1000
    ) -> None:
        self.client = client
        self.component = component
        self.host = host if host is not None else socket.gethostname()
        self.instance = f"{component}-{self.host}-{os.getpid()}"
        self.correlator = EventCorrelator()
        self._queue: asyncio.Queue[Obj] = asyncio.Queue(queue_size)
        self._task: asyncio.Task[None] | None = None

    def build(self, obj: Obj, event_type: str, reason: str, message: str) -> Obj:
        ref = object_reference(obj)
        ts = now_rfc3339()
        return {
            "metadata": {
                "name": f"{ref.get('name', 'unknown')}.{time.time_ns():x}",
                "namespace": ref.get("namespace") or "default",
            },
            "involvedObject": ref,
            "type": event_type,
            "reason": reason,
            "message": message,
            "source": {"component": self.component, "host": self.host}
            if self.host
            else {"component": self.component},
            "firstTimestamp": ts,
            "lastTimestamp": ts,
            "count": 1,
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
        }

    def record(self, obj: Obj, event_type: str, reason: str, message: str) -> None:
        event = self.build(obj, event_type, reason, message)
        log.debug(
            "event",
            object=event["involvedObject"].get("name"),
            type=event_type,
            reason=reason,
            message=message,
        )
        try:
            self._queue.put_nowait(event)
        except asyncio.QueueFull:
            log.warning("event queue full, dropping event", reason=reason, message=message)
            return
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._writer())

    def normal(self, obj: Obj, reason: str, message: str) -> None:
        self.record(obj, NORMAL, reason, message)

    def warning(self, obj: Obj, reason: str, message: str) -> None:
        self.record(obj, WARNING, reason, message)

    async def _writer(self) -> None:
        while True:
            event = await self._queue.get()
            try:
                await self.write(event)
            except WritesStoppedError:
                log.debug("event not written: writes stopped", reason=event["reason"])
            except Exception as exc:  # events are best effort, as in client-go
                log.warning("could not write event", reason=event["reason"], error=str(exc))
            finally:
                self._queue.task_done()

    async def write(self, event: Obj) -> Obj:
        agg = self.correlator.observe(event)
        if agg is not None:
            patch = {"count": agg.count, "lastTimestamp": event["lastTimestamp"]}
            try:
                return await self.client.patch(EVENTS, agg.name, patch, namespace=agg.namespace)
            except ApiError as exc:
                if not exc.not_found:
                    raise
                self.correlator.forget(event)  # the Event expired (TTL): start a new one
        created = await self.client.create(EVENTS, event)
        self.correlator.remember(created)
        return created

    async def flush(self) -> None:
        """Waits until every queued event is written (tests and shutdown)."""
        await self._queue.join()

    async def close(self) -> None:
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.flush(), 5)
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
