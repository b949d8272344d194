"""A test-time check that nobody writes into an informer's cache (client-go's cache mutation
detector, KUBE_CACHE_MUTATION_DETECTOR).

Cached objects are shared by every handler and worker of a process and are never copied (store.py):
a controller that edits one in place changes what every other reader decides on, and its next
write sends the edit without knowing it. With KUBELOOP_CACHE_MUTATION_DETECTOR=true each informer
keeps a deep copy of every object it caches and compares the two after the event's handlers ran
and again every second; a difference is logged and recorded in DETECTED, which the integration
tests' fixture turns into a failure. Off in production: it doubles the cache's memory.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

from .logs import get_logger
from .resources import Obj, key_of

log = get_logger("informer")

ENV = "KUBELOOP_CACHE_MUTATION_DETECTOR"
CHECK_PERIOD = 1.0


@dataclass(frozen=True)
class Mutation:
    resource: str
    key: str
    cached: Obj  # the object as it is now
    original: Obj  # the object as the informer stored it


# Every mutation any detector of this process found, in the order found.
DETECTED: list[Mutation] = []


def enabled() -> bool:
    return os.environ.get(ENV, "").lower() in ("1", "true")


class MutationDetector:
    def __init__(self, resource: str) -> None:
        self.resource = resource
        # By identity: the store's object and the copy taken when it was stored. An object the
        # store no longer holds is dropped at the next full check.
        self._copies: dict[int, tuple[Obj, Obj]] = {}

    def stored(self, obj: Obj) -> None:
        self._copies[id(obj)] = (obj, copy.deepcopy(obj))

    def forget(self, obj: Obj) -> None:
        self._copies.pop(id(obj), None)

    def check(self, objs: list[Obj] | None = None) -> None:
        """Compares the given cached objects (all that are tracked when None) with their copies."""
        entries = (
            list(self._copies.values())
            if objs is None
            else [e for o in objs if (e := self._copies.get(id(o))) is not None]
        )
        for cached, original in entries:
            if cached != original:
                found = Mutation(self.resource, key_of(cached), copy.deepcopy(cached), original)
                DETECTED.append(found)
                log.error("a cached object was mutated", resource=self.resource, key=found.key)
                self._copies[id(cached)] = (cached, copy.deepcopy(cached))  # report each edit once
