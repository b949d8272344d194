"""The pool's gauges on the driver's /metrics, so that a pool filling up, or promising more than its
disk holds, is seen before a write fails (docs/observability.md, "The pool's gauges"):

    kubeloop_pool_size_bytes{node, kind}          the kind's --capacity (KIND=SIZE, or the one SIZE
                                                  with kind ""); without --capacity the pool
                                                  filesystem's size
    kubeloop_pool_provisioned_bytes{node, kind}   the sizes of what holds room: volumes, snapshots and
                                                  inline volumes' reservations, as the budget counts
    kubeloop_pool_allocated_bytes{node, kind}     the blocks their backing files take on disk
                                                  (st_blocks * 512): what the sparse files really use
    kubeloop_pool_available_bytes{node, kind}     what GetCapacity offers the kind: size less
                                                  provisioned, or the filesystem's free space
                                                  without --capacity
    kubeloop_pool_filesystem_size_bytes{node}     the filesystem the pool lives on (statvfs), shared by
    kubeloop_pool_filesystem_free_bytes{node}     every kind, and what it can still give (f_bavail)

Only the process holding the pool's controller side exports them, once it has it: it alone counts
every record of the pool, and every inline volume's reservation whichever node made it. So there
is one set of series per pool and a sum over them counts nothing twice: in node-local mode each
node's process, `node` its --node-id; in shared mode the controller-mode process, `node` "" (the
pool is no node's), while the node plugins of a shared pool export none.

Values are read when /metrics is asked for (`refresh`, awaited by the HTTP endpoint before it
collects), in a thread: a statvfs, the reservations in ephemeral/, and a stat of every backing
file. At most one measurement runs at a time and a second scrape within MAX_AGE gets the last, so
however often the pool is scraped it is walked at most once a second.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from controller_runtime.logs import get_logger
from controller_runtime.metrics import GaugeMetricFamily

from .errors import CsiError
from .pool_kinds import PoolCapacity
from .state import DriverState

log = get_logger("csi.pool_metrics")

SIZE = "kubeloop_pool_size_bytes"
PROVISIONED = "kubeloop_pool_provisioned_bytes"
ALLOCATED = "kubeloop_pool_allocated_bytes"
AVAILABLE = "kubeloop_pool_available_bytes"
FILESYSTEM_SIZE = "kubeloop_pool_filesystem_size_bytes"
FILESYSTEM_FREE = "kubeloop_pool_filesystem_free_bytes"
KIND_LABELS = ["node", "kind"]
NODE_LABELS = ["node"]
HELP = {
    SIZE: "The pool kind's --capacity; without --capacity, the size of the filesystem the pool lives on",
    PROVISIONED: "Bytes the pool kind has promised: the sizes of its volumes, snapshots and inline "
    "volumes, as its --capacity budget counts them",
    ALLOCATED: "Bytes the backing files of the pool kind's volumes, snapshots and inline volumes take "
    "on disk (sparse files: what has been written)",
    AVAILABLE: "Bytes the driver still offers the pool kind (GetCapacity): its --capacity less what is "
    "provisioned, or the free space of the pool's filesystem without --capacity",
    FILESYSTEM_SIZE: "Size of the filesystem the pool lives on, shared by every pool kind",
    FILESYSTEM_FREE: "Bytes the filesystem the pool lives on can still give (statvfs f_bavail); a thin "
    "pool has promised more than this when provisioned less allocated exceeds it",
}
MAX_AGE = 1.0  # seconds a measurement is served again instead of walking the pool anew


@dataclass(frozen=True)
class Holder:
    """One thing that holds room in the pool: its size, its kind and its backing file."""

    path: str
    kind: str
    size: int


@dataclass(frozen=True)
class KindUsage:
    size: int
    provisioned: int
    allocated: int
    available: int


@dataclass(frozen=True)
class PoolUsage:
    kinds: dict[str, KindUsage]
    filesystem_size: int
    filesystem_free: int


def allocated(path: str) -> int:
    """The bytes a backing file takes on disk; 0 when it is gone, not yet made, or not a regular
    file (the driver never uses a pool entry swapped for a symlink either)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512 if stat.S_ISREG(st.st_mode) else 0


def measure(pool_dir: str, capacity: PoolCapacity, holders: list[Holder]) -> PoolUsage:
    """The pool's usage per kind, from what holds room in it. Blocking: run it in a thread.

    Without kinds every holder counts under kind "" (as the budget counts a pool without kinds,
    whatever kind a record was made with); with kinds, a kind no longer configured still shows
    what it holds, with size 0."""
    fs = os.statvfs(pool_dir)
    fs_size, fs_free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    provisioned: dict[str, int] = dict.fromkeys(capacity.kinds or {"": 0}, 0)
    used: dict[str, int] = dict(provisioned)
    for h in holders:
        kind = h.kind if capacity.kinds else ""
        provisioned[kind] = provisioned.get(kind, 0) + h.size
        used[kind] = used.get(kind, 0) + allocated(h.path)
    kinds: dict[str, KindUsage] = {}
    for kind, promised in sorted(provisioned.items()):
        if not capacity.budgeted:  # thin: the filesystem decides (PoolBudget.room)
            kinds[kind] = KindUsage(fs_size, promised, used[kind], fs_free)
            continue
        size = capacity.kinds.get(kind, 0) if capacity.kinds else capacity.total
        kinds[kind] = KindUsage(size, promised, used[kind], max(0, size - promised))
    return PoolUsage(kinds, fs_size, fs_free)


class PoolMetrics:
    """The gauges of the pool whose controller side this process holds."""

    def __init__(
        self,
        state: DriverState,
        capacity: PoolCapacity,
        node: str,
        max_age: float = MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.capacity = capacity
        self.node = node
        self.max_age = max_age
        self.clock = clock
        self.usage: PoolUsage | None = None
        self._measuring: asyncio.Future[None] | None = None
        self._measured_at = 0.0

    def _records(self) -> list[Holder]:
        """What the records hold, read on the event loop that changes them."""
        return [
            *(
                Holder(self.state.volume_file(v.volume_id), v.kind, v.capacity)
                for v in self.state.list_volumes()
            ),
            *(
                Holder(self.state.snapshot_file(s.snapshot_id), s.kind, s.size)
                for s in self.state.list_snapshots()
            ),
        ]

    def _reservations(self) -> list[Holder]:
        """What inline volumes hold, every node's (blocking: their files in ephemeral/)."""
        holders = []
        for r in self.state.budget.reservations().values():
            try:
                path = self.state.ephemeral_file(r.volume_id)
            except CsiError:  # not an id the driver makes a file for: it holds room, no file
                path = ""
            holders.append(Holder(path, r.kind, r.size))
        return holders

    def _measure(self, records: list[Holder]) -> PoolUsage:
        return measure(str(self.state.pool_dir), self.capacity, records + self._reservations())

    async def _refresh(self) -> None:
        self._measured_at = self.clock()
        try:
            self.usage = await asyncio.to_thread(self._measure, self._records())
        except OSError as e:
            # No series rather than old ones: the pool's problem is reported by Probe and /readyz.
            self.usage = None
            log.warning("cannot measure the pool; its gauges are left out", error=str(e))

    async def refresh(self) -> None:
        """Measures the pool, unless a measurement runs (then waits for it) or the last one is
        under `max_age` old."""
        running = self._measuring
        if running is None or (running.done() and self.clock() - self._measured_at >= self.max_age):
            running = self._measuring = asyncio.ensure_future(self._refresh())
        await asyncio.shield(running)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families(self.usage)

    def _families(self, usage: PoolUsage | None = None) -> Iterator[GaugeMetricFamily]:
        per_kind = {
            name: GaugeMetricFamily(name, HELP[name], labels=KIND_LABELS)
            for name in (SIZE, PROVISIONED, ALLOCATED, AVAILABLE)
        }
        per_node = {
            name: GaugeMetricFamily(name, HELP[name], labels=NODE_LABELS)
            for name in (FILESYSTEM_SIZE, FILESYSTEM_FREE)
        }
        if usage is not None:
            for kind, u in usage.kinds.items():
                per_kind[SIZE].add_metric([self.node, kind], u.size)
                per_kind[PROVISIONED].add_metric([self.node, kind], u.provisioned)
                per_kind[ALLOCATED].add_metric([self.node, kind], u.allocated)
                per_kind[AVAILABLE].add_metric([self.node, kind], u.available)
            per_node[FILESYSTEM_SIZE].add_metric([self.node], usage.filesystem_size)
            per_node[FILESYSTEM_FREE].add_metric([self.node], usage.filesystem_free)
        yield from per_kind.values()
        yield from per_node.values()
