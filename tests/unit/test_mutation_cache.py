"""controller_runtime.mutation_cache: the one overlay of a controller's own writes on its informer's
read-only store, newest by resourceVersion (issue 30)."""

from __future__ import annotations

from controller_runtime.clock_testing import FakeClock
from controller_runtime.mutation_cache import MutationCache
from controller_runtime.resources import Obj
from controller_runtime.store import Store


def obj(name: str, rv: int, uid: str = "u1", **extra: object) -> Obj:
    return {"metadata": {"name": name, "resourceVersion": str(rv), "uid": uid, **extra}, "spec": {}}


def test_a_write_newer_than_the_store_is_read_until_the_store_catches_up() -> None:
    store, clock = Store(), FakeClock()
    cache = MutationCache(store, clock=clock)
    store.upsert(obj("a", 5))
    written = obj("a", 7)
    cache.mutated(written)
    assert cache.get("a") is written
    caught_up = obj("a", 7)
    store.upsert(caught_up)
    assert cache.get("a") is caught_up and cache.pending() == 0


def test_an_older_answer_never_replaces_a_newer_one() -> None:
    store = Store()
    cache = MutationCache(store, clock=FakeClock())
    store.upsert(obj("a", 5))
    newest = obj("a", 9)
    cache.mutated(newest)
    cache.mutated(obj("a", 8))
    assert cache.get("a") is newest
    cache.mutated(obj("a", 4))
    assert cache.get("a") is newest


def test_a_deletion_or_another_uid_in_the_store_wins_whatever_the_versions() -> None:
    store = Store()
    cache = MutationCache(store, clock=FakeClock())
    store.upsert(obj("a", 5))
    cache.mutated(obj("a", 9))
    deleting = obj("a", 6, deletionTimestamp="2026-01-01T00:00:00Z")
    store.upsert(deleting)
    assert cache.get("a") is deleting
    cache.mutated(obj("a", 10))
    recreated = obj("a", 3, uid="u2")
    store.upsert(recreated)
    assert cache.get("a") is recreated


def test_without_adds_an_object_the_store_lacks_is_gone() -> None:
    store = Store()
    cache = MutationCache(store, clock=FakeClock())
    cache.mutated(obj("a", 9))
    assert cache.get("a") is None and cache.pending() == 0
    assert list(cache.values()) == [] and len(cache) == 0


def test_with_adds_a_late_answer_cannot_bring_a_deleted_object_back() -> None:
    store = Store()
    cache = MutationCache(store, include_adds=True, clock=FakeClock())
    fetched = obj("a", 5)
    cache.mutated(fetched)  # read from the API before the watch delivered it
    assert cache.get("a") is fetched and cache.keys() == {"a"}
    cache.deleted(obj("a", 6))
    cache.mutated(obj("a", 5))
    assert cache.get("a") is None
    again = obj("a", 12, uid="u2")
    cache.mutated(again)
    assert cache.get("a") is again


def test_answers_expire_after_the_ttl() -> None:
    store, clock = Store(), FakeClock()
    cache = MutationCache(store, ttl=60, clock=clock)
    cached = obj("a", 5)
    store.upsert(cached)
    cache.mutated(obj("a", 7))
    clock.step(61)
    assert cache.get("a") is cached and cache.pending() == 0


def test_values_read_through_the_overlay() -> None:
    store = Store()
    cache = MutationCache(store, clock=FakeClock())
    store.upsert(obj("a", 1))
    b = obj("b", 2)
    store.upsert(b)
    newer_a = obj("a", 3)
    cache.mutated(newer_a)
    assert sorted((o["metadata"]["name"], o is newer_a or o is b) for o in cache.values()) == [
        ("a", True),
        ("b", True),
    ]
