"""The reflector: list, then watch from the list's resourceVersion, keeping a Store in step.

Decisions (see `next_step`): a watch that the server ended on its timeout, or whose connection
dropped, resumes from the last resourceVersion seen (events and bookmarks advance it); a watch or
list that fails with 410 Gone means etcd no longer has that version, so the reflector re-lists
from scratch; any other error backs off exponentially before trying again.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .client import ApiClient, ApiError, WatchExpiredError
from .http_client import Disconnected
from .logs import get_logger
from .memory import release_free_memory
from .metrics import Counter
from .resources import Obj, Resource, resource_version

log = get_logger("reflector")

LISTS = Counter("reflector_lists_total", "Full lists made by reflectors", ["resource"])
WATCHES = Counter("reflector_watches_total", "Watches started by reflectors", ["resource"])


class Step(enum.Enum):
    RESUME = "resume"  # watch again from the last resourceVersion, at once
    RELIST = "relist"  # the resourceVersion is gone: list again
    BACKOFF = "backoff"  # unexpected failure: wait, then resume the watch


def next_step(error: BaseException | None) -> Step:
    """What the reflector does after a watch ended with `error` (None: ended normally)."""
    if error is None:
        return Step.RESUME
    if isinstance(error, WatchExpiredError) or (isinstance(error, ApiError) and error.gone):
        return Step.RELIST
    if isinstance(error, Disconnected | TimeoutError):
        return Step.RESUME  # the connection dropped; the resourceVersion is still good
    return Step.BACKOFF


@dataclass
class Backoff:
    """Exponential backoff with jitter: 0.8s doubling to 30s, reset after a healthy watch."""

    initial: float = 0.8
    maximum: float = 30.0
    _current: float = field(default=0.0, init=False)

    def next(self) -> float:
        self._current = self.initial if self._current == 0 else min(self.maximum, self._current * 2)
        return self._current * (1 + random.random() * 0.2)

    def reset(self) -> None:
        self._current = 0.0


class Handler:
    """What the reflector reports to (an informer implements it)."""

    def on_replace(self, items: list[Obj], resource_version: str) -> None: ...
    def on_event(self, kind: str, obj: Obj) -> None: ...


class Reflector:
    def __init__(
        self,
        client: ApiClient,
        resource: Resource,
        handler: Handler,
        *,
        namespace: str | None = None,
        label_selector: str = "",
        field_selector: str = "",
        watch_timeout: tuple[int, int] = (300, 600),
        transform: Callable[[Obj], Obj] | None = None,
        page_size: int = 100,
    ) -> None:
        self.client = client
        self.resource = resource
        self.handler = handler
        self.namespace = namespace
        self.selectors: dict[str, Any] = {"labelSelector": label_selector, "fieldSelector": field_selector}
        self.watch_timeout = watch_timeout
        self.transform = transform
        self.page_size = page_size
        self.last_resource_version = ""
        self.backoff = Backoff()

    async def list(self) -> None:
        """Lists everything in pages. Paging keeps the transient memory of a decode to one page,
        so a large cache does not leave a high-water mark of garbage behind it; on 1.36 the
        apiserver serves these consistent pages from its watch cache."""
        LISTS.labels(self.resource.plural).inc()
        items: list[Obj] = []
        token = ""
        while True:
            page = await self.client.list_page(
                self.resource, self.namespace, limit=self.page_size, continue_=token, **self.selectors
            )
            batch = page.get("items") or []
            transform = self.transform
            items.extend(map(transform, batch) if transform is not None else batch)
            token = page.get("metadata", {}).get("continue", "")
            if not token:
                rv = str(page.get("metadata", {}).get("resourceVersion", ""))
                break
        self.last_resource_version = rv
        self.handler.on_replace(items, rv)
        if len(items) >= self.page_size:
            release_free_memory()

    async def watch(self) -> None:
        WATCHES.labels(self.resource.plural).inc()
        timeout = random.randint(*self.watch_timeout)
        async for kind, obj in self.client.watch(
            self.resource,
            self.namespace,
            resource_version=self.last_resource_version,
            timeout_seconds=timeout,
            **self.selectors,
        ):
            rv = resource_version(obj)
            if kind != "BOOKMARK":
                if self.transform is not None:
                    obj = self.transform(obj)
                self.handler.on_event(kind, obj)
            if rv:
                self.last_resource_version = rv
            self.backoff.reset()

    async def run(self) -> None:
        """Runs until cancelled. Started again after a stop, it resumes the watch from the last
        resourceVersion it saw: the cache is still exact up to that version."""
        need_list = not self.last_resource_version
        while True:
            try:
                if need_list:
                    await self.list()
                    need_list = False
                    self.backoff.reset()
                await self.watch()
                error: BaseException | None = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # every failure is decided by next_step
                error = exc
            step = next_step(error)
            if step is Step.RELIST:
                log.info(
                    "resourceVersion expired, re-listing",
                    resource=self.resource.plural,
                    resource_version=self.last_resource_version,
                )
                need_list = True
            elif step is Step.BACKOFF:
                delay = self.backoff.next()
                log.warning(
                    "list/watch failed, backing off",
                    resource=self.resource.plural,
                    error=str(error),
                    delay=f"{delay:.1f}s",
                )
                await asyncio.sleep(delay)
