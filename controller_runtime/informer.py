"""Shared informers: one reflector and one indexed Store per resource per process, fanned out to
every registered handler, with periodic resync (handlers see on_update(obj, obj) for everything).

Handlers are plain synchronous callables and must stay cheap (enqueue a key): business logic
belongs in a controller's sync, never in a handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import mutation_detector
from .client import ApiClient
from .logs import get_logger
from .reflector import Handler, Reflector
from .resources import Obj, Resource
from .store import IndexFunc, Store

log = get_logger("informer")


# Values unique to one object: interning them would only add table entries. Within the object they
# are still shared (a provisioned PV's name and volumeHandle are the same string). Timestamps are not
# here: objects made in one burst share their second.
_UNIQUE_VALUE_KEYS = frozenset({"uid", "name", "resourceVersion", "volumeHandle", "generateName"})


def _share_strings(node: Any, local: dict[str, str]) -> None:
    """Replaces repeated string values (access modes, phases, driver and class names, label and
    annotation values...) by one shared instance each. Thousands of cached objects then hold
    pointers to one "ReadWriteOnce" instead of thousands of copies. CPython's interned strings are
    freed with their last reference, so this never grows without bound."""
    # Exact type tests: orjson decodes to plain dicts, lists and strs, and `type(v) is dict` costs
    # a fraction of `isinstance(v, dict | list)` (this walk runs over every watched object: 5 % of
    # the provisioner's busy samples over 1,000 claims).
    if type(node) is dict:
        for key, value in node.items():
            kind = type(value)
            if kind is str:
                node[key] = local.setdefault(value, value) if key in _UNIQUE_VALUE_KEYS else sys.intern(value)
            elif kind is dict or kind is list:
                _share_strings(value, local)
    elif type(node) is list:
        for i, value in enumerate(node):
            kind = type(value)
            if kind is str:
                node[i] = sys.intern(value)
            elif kind is dict or kind is list:
                _share_strings(value, local)


def compact(obj: Obj) -> Obj:
    """The transform every informer applies before caching: controllers never read
    managedFields (often half an object's size), and repeated strings are shared."""
    md = obj.get("metadata")
    if md is not None:
        md.pop("managedFields", None)
    _share_strings(obj, {})
    return obj


RawObserver = Callable[[Obj | None, Obj], None]


@dataclass
class EventHandler:
    on_add: Callable[[Obj], None] | None = None
    on_update: Callable[[Obj, Obj], None] | None = None
    on_delete: Callable[[Obj], None] | None = None


class SharedInformer(Handler):
    def __init__(
        self,
        client: ApiClient,
        resource: Resource,
        *,
        namespace: str | None = None,
        resync_period: float = 0.0,
        label_selector: str = "",
        field_selector: str = "",
    ) -> None:
        self.resource = resource
        self.store = Store()
        self.resync_period = resync_period
        self._handlers: list[EventHandler] = []
        self._raw_observers: list[RawObserver] = []
        self._synced = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._detector = (
            mutation_detector.MutationDetector(resource.plural) if mutation_detector.enabled() else None
        )
        self.reflector = Reflector(
            client,
            resource,
            self,
            namespace=namespace,
            label_selector=label_selector,
            field_selector=field_selector,
            transform=self._admit,
        )

    # -- registration -------------------------------------------------------------------------

    def add_handler(self, handler: EventHandler) -> None:
        """Registers a handler; if the cache is already filled, it first sees every object as added."""
        self._handlers.append(handler)
        if self._synced.is_set() and handler.on_add is not None:
            for obj in self.store.values():
                handler.on_add(obj)

    def observe_raw(self, observer: RawObserver) -> None:
        """Registers `observer(old, new)` for what the reflector delivers once the cache has
        synced: `new` as the API served it, managedFields included, before `compact` drops them;
        `old` the cached copy it replaces (None for an object new to the cache). The first list is
        not observed. Every object of a watch event or a re-list passes, deletions included; like a
        handler, an observer must stay cheap and must not change either object."""
        self._raw_observers.append(observer)

    def _admit(self, obj: Obj) -> Obj:
        if self._raw_observers and self._synced.is_set():
            old = self.store.get(self.store.key(obj))
            for observe in self._raw_observers:
                try:
                    observe(old, obj)
                except Exception:
                    log.exception("raw observer failed", resource=self.resource.plural)
        return compact(obj)

    def add_index(self, name: str, func: IndexFunc) -> None:
        if not self.store.has_index(name):
            self.store.add_index(name, func)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def has_synced(self) -> bool:
        return self._synced.is_set()

    async def wait_for_sync(self) -> None:
        await self._synced.wait()

    def start(self) -> None:
        if self._tasks:
            return
        self._tasks.append(
            asyncio.create_task(self.reflector.run(), name=f"reflector-{self.resource.plural}")
        )
        if self.resync_period > 0:
            self._tasks.append(
                asyncio.create_task(self._resync_loop(), name=f"resync-{self.resource.plural}")
            )
        if self._detector is not None:
            self._tasks.append(
                asyncio.create_task(
                    self._detect_mutations(self._detector), name=f"detector-{self.resource.plural}"
                )
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def _detect_mutations(self, detector: mutation_detector.MutationDetector) -> None:
        while True:
            await asyncio.sleep(mutation_detector.CHECK_PERIOD)
            detector.check()

    async def _resync_loop(self) -> None:
        await self._synced.wait()
        while True:
            await asyncio.sleep(self.resync_period)
            for n, key in enumerate(self.store.keys(), 1):
                if n % 200 == 0:
                    await asyncio.sleep(0)  # let responses and watch events in between
                obj = self.store.get(key)  # the current copy: events may have come in meanwhile
                if obj is not None:
                    self._dispatch_update(obj, obj)

    # -- reflector callbacks ------------------------------------------------------------------

    def on_replace(self, items: list[Obj], resource_version: str) -> None:
        added, updated, deleted = self.store.replace(items)
        if self._detector is not None:
            for obj in deleted:
                self._detector.forget(obj)
            for obj in items:
                self._detector.stored(obj)
        for obj in deleted:
            self._dispatch_delete(obj)
        for obj in added:
            self._dispatch_add(obj)
        for old, new in updated:
            self._dispatch_update(old, new)
        if self._detector is not None:
            self._detector.check(items)
        if not self._synced.is_set():
            log.info(
                "cache synced",
                resource=self.resource.plural,
                objects=len(self.store),
                resource_version=resource_version,
            )
            self._synced.set()

    def on_event(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            old = self.store.delete(self.store.key(obj))
            self._dispatch_delete(old if old is not None else obj)
            if self._detector is not None and old is not None:
                self._detector.check([old])
                self._detector.forget(old)
            return
        old = self.store.upsert(obj)
        if self._detector is not None:
            self._detector.stored(obj)
        if old is None:
            self._dispatch_add(obj)
        else:
            self._dispatch_update(old, obj)
        if self._detector is not None:
            self._detector.check([obj] if old is None else [old, obj])
            if old is not None:
                self._detector.forget(old)

    def _dispatch_add(self, obj: Obj) -> None:
        for h in self._handlers:
            if h.on_add is not None:
                self._guard(h.on_add, obj)

    def _dispatch_update(self, old: Obj, new: Obj) -> None:
        for h in self._handlers:
            if h.on_update is not None:
                self._guard(h.on_update, old, new)

    def _dispatch_delete(self, obj: Obj) -> None:
        for h in self._handlers:
            if h.on_delete is not None:
                self._guard(h.on_delete, obj)

    def _guard(self, fn: Callable[..., None], *args: Obj) -> None:
        # A failing handler must not stop the reflector or starve the other handlers.
        try:
            fn(*args)
        except Exception:
            log.exception("event handler failed", resource=self.resource.plural)


class SharedInformerFactory:
    """Hands out one SharedInformer per (resource, namespace, selectors) so a process watches
    each resource once. A request with other selectors gets an informer of its own: a cache of
    this node's pods is not a cache of every pod, and must never be handed to a controller that
    asked for all of them (client-go's factory, made with a tweak, serves only what it lists)."""

    def __init__(self, client: ApiClient, resync_period: float = 0.0) -> None:
        self.client = client
        self.resync_period = resync_period
        self._informers: dict[tuple[Resource, str | None, str, str], SharedInformer] = {}

    def informer(
        self,
        resource: Resource,
        namespace: str | None = None,
        *,
        label_selector: str = "",
        field_selector: str = "",
    ) -> SharedInformer:
        """The process's informer of `resource` in `namespace` (None: every namespace) listing
        what the selectors select (client-go's WithNamespace and WithTweakListOptions, here per
        informer). One asked for after `start` starts at the next `start`, as in client-go."""
        key = (resource, namespace, label_selector, field_selector)
        if key not in self._informers:
            self._informers[key] = SharedInformer(
                self.client,
                resource,
                namespace=namespace,
                resync_period=self.resync_period,
                label_selector=label_selector,
                field_selector=field_selector,
            )
        return self._informers[key]

    def start(self) -> None:
        for informer in self._informers.values():
            informer.start()

    async def wait_for_sync(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(i.wait_for_sync() for i in self._informers.values())), timeout
        )

    @property
    def has_synced(self) -> bool:
        return all(i.has_synced for i in self._informers.values())

    async def stop(self) -> None:
        await asyncio.gather(*(i.stop() for i in self._informers.values()))
