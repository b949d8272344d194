"""The one overlay for "my write is newer than my cache" (client-go's MutationCache).

A controller that writes an object gets the API's answer at once, but its informer's store holds
the older version until the watch delivers the newer one; a sync in between would decide on what
the controller itself already changed (attach a volume twice, provision twice, patch twice). The
informer's store stays read-only (only the reflector writes it); a controller keeps its writes'
answers here, and reads through this cache, which hands out whichever of the two is newer by
resourceVersion (one etcd revision counter orders every version of every object).

A write answer is dropped as soon as the store holds that version or a newer one, when the object
is deleted, and after `ttl` seconds in any case (a watch that never catches up must not pin an old
answer forever).

Two kinds of reader:
- `include_adds=False` (the external-attacher, the provisioner, the resizer): an answer is kept
  only while the store holds the object; a deletion the store has seen wins.
- `include_adds=True` (the pv-controller, like kcm's own volume and claim caches): an object the
  API returned before the watch delivered it is served too, and a deletion leaves a tombstone so a
  late answer (an older version) cannot bring the object back.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .clock import SYSTEM_CLOCK, PassiveClock
from .resources import Obj, key_of, revision_of
from .store import Store

# How long a write answer may stand in for the store's copy: the watch normally catches up in
# milliseconds; a minute covers an apiserver restart's relist.
DEFAULT_TTL = 60.0
TOMBSTONES = 10_000


class MutationCache:
    def __init__(
        self,
        store: Store,
        *,
        include_adds: bool = False,
        ttl: float = DEFAULT_TTL,
        clock: PassiveClock = SYSTEM_CLOCK,
    ) -> None:
        self._store = store
        self._include_adds = include_adds
        self._ttl = ttl
        self._clock = clock
        self._written: dict[str, tuple[Obj, float]] = {}  # key -> (answer, when it was written)
        self._tombstones: OrderedDict[str, int] = OrderedDict()  # key -> resourceVersion deleted

    def get(self, key: str) -> Obj | None:
        """The newer of the store's object and this controller's last write of it."""
        cached = self._store.get(key)
        mine = self._mine(key)
        if mine is None:
            return cached
        if cached is None:
            if self._include_adds:
                return mine
            self._written.pop(key, None)  # the store has seen it deleted, or never had it
            return None
        if _supersedes(cached, mine):
            self._written.pop(key, None)
            return cached
        return mine

    def mutated(self, obj: Obj) -> None:
        """Records the answer to a write (an update, a patch, a create with `include_adds`)."""
        key = key_of(obj)
        dead = self._tombstones.get(key)
        if dead is not None:
            if revision_of(obj) <= dead:
                return  # an answer from before the deletion the store has seen
            del self._tombstones[key]
        held = self._mine(key)
        if held is not None and revision_of(held) > revision_of(obj):
            return
        self._written[key] = (obj, self._clock.monotonic())

    def deleted(self, obj: Obj) -> None:
        """The store has seen the object deleted (call from the informer's delete handler): its
        write answer goes, and with `include_adds` a tombstone keeps older answers out."""
        key = key_of(obj)
        held = self._written.pop(key, None)
        if not self._include_adds:
            return
        rv = max(revision_of(obj), revision_of(held[0]) if held is not None else 0)
        self._tombstones[key] = rv
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    def keys(self) -> set[str]:
        keys = set(self._store.keys())
        if self._include_adds:
            keys.update(k for k in list(self._written) if self._mine(k) is not None)
        return keys

    def values(self) -> Iterator[Obj]:
        """Every object as `get` would return it."""
        for key in self.keys():
            obj = self.get(key)
            if obj is not None:
                yield obj

    def __len__(self) -> int:
        return len(self.keys())

    def pending(self) -> int:
        """How many write answers stand in for the store's copy now (for tests and logs)."""
        return len(self._written)

    def _mine(self, key: str) -> Obj | None:
        entry = self._written.get(key)
        if entry is None:
            return None
        obj, written_at = entry
        if self._clock.monotonic() - written_at > self._ttl:
            del self._written[key]
            return None
        return obj


def _supersedes(cached: Obj, mine: Obj) -> bool:
    """Whether the store's copy wins over a write answer: it is as new or newer, it is another
    object of that name (another UID), or it is being deleted and the answer is not. The last two
    hold whatever the versions say (should they ever go backwards, an etcd restore, a deleted
    object must still be treated as deleted)."""
    cached_md, mine_md = cached.get("metadata", {}), mine.get("metadata", {})
    return (
        revision_of(cached) >= revision_of(mine)
        or cached_md.get("uid") != mine_md.get("uid")
        or bool(cached_md.get("deletionTimestamp") and not mine_md.get("deletionTimestamp"))
    )
