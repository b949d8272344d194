"""A thread-free indexer: objects by key, plus named secondary indexes (client-go's cache.Indexer).

An index function maps an object to the index values it should be found under; `by_index(name, v)`
returns every object indexed under v. The store never copies objects: callers must not mutate what
they read from it (copy first with `copy.deepcopy` or build a new dict for writes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .resources import Obj, key_of

IndexFunc = Callable[[Obj], Iterable[str]]


class Store:
    def __init__(self, key_func: Callable[[Obj], str] = key_of) -> None:
        self._key = key_func
        self._items: dict[str, Obj] = {}
        self._indexers: dict[str, IndexFunc] = {}
        self._indices: dict[str, dict[str, set[str]]] = {}

    # -- indexes ----------------------------------------------------------------------------

    def add_index(self, name: str, func: IndexFunc) -> None:
        """Registers an index; objects already stored are indexed at once."""
        if name in self._indexers:
            raise ValueError(f"index {name!r} already exists")
        self._indexers[name] = func
        self._indices[name] = {}
        for key, obj in self._items.items():
            self._index_one(name, key, obj)

    def has_index(self, name: str) -> bool:
        return name in self._indexers

    def _index_one(self, name: str, key: str, obj: Obj) -> None:
        index = self._indices[name]
        for value in self._indexers[name](obj):
            index.setdefault(value, set()).add(key)

    def _unindex_one(self, name: str, key: str, obj: Obj) -> None:
        index = self._indices[name]
        for value in self._indexers[name](obj):
            keys = index.get(value)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del index[value]

    def by_index(self, name: str, value: str) -> list[Obj]:
        return [self._items[k] for k in self._indices[name].get(value, ())]

    def index_keys(self, name: str, value: str) -> list[str]:
        return sorted(self._indices[name].get(value, ()))

    def index_values(self, name: str) -> list[str]:
        return list(self._indices[name])

    # -- objects ----------------------------------------------------------------------------

    def key(self, obj: Obj) -> str:
        return self._key(obj)

    def get(self, key: str) -> Obj | None:
        return self._items.get(key)

    def values(self) -> list[Obj]:
        return list(self._items.values())

    def keys(self) -> list[str]:
        return list(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def upsert(self, obj: Obj) -> Obj | None:
        """Adds or replaces an object; returns the one it replaced."""
        key = self._key(obj)
        old = self._items.get(key)
        if old is not None:
            for name in self._indexers:
                self._unindex_one(name, key, old)
        self._items[key] = obj
        for name in self._indexers:
            self._index_one(name, key, obj)
        return old

    def delete(self, key: str) -> Obj | None:
        old = self._items.pop(key, None)
        if old is not None:
            for name in self._indexers:
                self._unindex_one(name, key, old)
        return old

    def replace(self, objs: Iterable[Obj]) -> tuple[list[Obj], list[tuple[Obj, Obj]], list[Obj]]:
        """Makes the store hold exactly `objs` (a re-list). Returns (added, updated as (old, new),
        deleted) so an informer can tell its handlers what changed while it was not watching."""
        fresh = {self._key(o): o for o in objs}
        deleted = [self._items[k] for k in self._items.keys() - fresh.keys()]
        for obj in deleted:
            self.delete(self._key(obj))
        added: list[Obj] = []
        updated: list[tuple[Obj, Obj]] = []
        for obj in fresh.values():
            old = self.upsert(obj)
            if old is None:
                added.append(obj)
            else:
                updated.append((old, obj))
        return added, updated, deleted
