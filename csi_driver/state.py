"""The driver's one durable state object: what the controller created (volumes, snapshots,
publications) and what this node staged, plus the pool layout and per-volume locks.

Records are reached only through methods that hand out copies, and a record changes in one place:
`put_*` writes it durably, and only then does the state hold (a copy of) the new version. A caller
edits its own copy under the volume's lock; if the write fails, memory still says what the disk
says, so the CO's retry does the work again instead of finding it "already done" in memory only.

State directory (--state-dir):
    volumes/<volume-id>.json      a VolumeRecord (controller)
    snapshots/<snapshot-id>.json  a SnapshotRecord (controller)
    staging/<volume-id>.json      a StagingRecord (node)
    .lock                         held by the one process that owns this state directory
Pool directory (--pool-dir, shared by the controller and every node plugin that can reach it):
    volumes/<volume-id>.img       sparse backing file
    snapshots/<snapshot-id>.img   sparse copy taken by CreateSnapshot
    ephemeral/<volume-id>.img     an inline ephemeral volume, made and removed by a node plugin
    ephemeral/<volume-id>.json    its reservation in the pool's budget (csi_driver.budget)
    budget.json, .budget.lock     the pool's --capacity budget, shared by every process on the
                                  pool (csi_driver.budget)
    freezes/                      requests to freeze staged filesystems for a group snapshot
                                  (csi_driver.freeze)
    nodes/<node-id>.json          written by each node plugin at start so the controller knows it
    .controller.lock              held by the one controller serving the pool

Any number of processes start on one pool at once: nothing in it has a fixed name that two of
them create, rename or delete (temporary files are named per writer, see controller_runtime.files),
and only the lock holder sweeps what a killed writer left.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller_runtime.files import FileLock
from controller_runtime.logs import get_logger

from .backend.store import RecordStore, write_json_atomic
from .budget import PoolBudget
from .errors import CsiError
from .validation import check_id

log = get_logger("csi.state")


@dataclass
class VolumeRecord:
    volume_id: str
    name: str
    capacity: int
    seq: int
    access_type: str  # "mount" or "block"
    fs_type: str  # for mount volumes; "" for block
    parameters: dict[str, str] = field(default_factory=dict)
    source_kind: str = ""  # "", "snapshot" or "volume"
    source_id: str = ""
    topology: list[dict[str, str]] = field(default_factory=list)
    published: dict[str, bool] = field(default_factory=dict)  # node id -> readonly
    # node id -> the access mode it was published with (absent in records older than the field)
    published_modes: dict[str, int] = field(default_factory=dict)
    ready: bool = False  # False until the backing file is complete (a crash mid-create is resumed)
    created_at: float = field(default_factory=time.time)
    kind: str = ""  # the pool kind whose budget it takes (--capacity KIND=SIZE); "" without kinds
    # The mutable parameters the backing file has been given (csi_driver.mutable), every key ever
    # set with its last value; a key never set has the attribute's default.
    mutable_parameters: dict[str, str] = field(default_factory=dict)
    # Node-local pools (csi_driver.transfer): the node a restore or clone pulls its source from
    # ("" for a local source); while a move (controller_runtime.volume_moves) is under way, the
    # PV it is for and the node this copy leaves for (on the source) or comes from (on the target).
    source_node: str = ""
    move_pv: str = ""
    leaving_to: str = ""
    incoming_from: str = ""
    # The generation (csi_driver.transfer.server.file_generation) of the source a move's copy was
    # pulled from: a copy is switched to only while the source is still that file.
    pulled_generation: str = ""


@dataclass
class SnapshotRecord:
    snapshot_id: str
    name: str
    source_volume_id: str
    size: int
    seq: int
    ready: bool = False
    created_at: float = field(default_factory=time.time)
    # What the source volume held when the copy was taken ("" in records older than these fields).
    access_type: str = ""
    fs_type: str = ""
    kind: str = ""  # its source volume's pool kind, whose budget it takes
    # A member of a volume group snapshot (GroupController): the group's id and name; "" alone.
    group_snapshot_id: str = ""
    group_name: str = ""


@dataclass
class StagingRecord:
    volume_id: str
    staging_path: str
    access_type: str
    fs_type: str = ""
    device: str = ""  # the loop device; "" until attached (or after a reboot detached it)
    # A second, read-only loop device for read-only publishes of a block volume staged
    # read-write; "" until the first such publish.
    ro_device: str = ""
    mount_flags: list[str] = field(default_factory=list)
    read_only: bool = False
    access_mode: int = 0
    targets: dict[str, bool] = field(default_factory=dict)  # target path -> readonly
    # Targets the driver made itself (file or directory): only these are removed at unpublish.
    created_targets: list[str] = field(default_factory=list)
    # Set while resize2fs grows the filesystem offline: a stage that finds it set knows the
    # filesystem may carry the damage of a killed resize2fs, and only that damage.
    growing: bool = False
    # Set while mkfs runs: data on a device without a filesystem is refused, except the half a
    # killed mkfs of this very staging wrote.
    formatting: bool = False
    # An inline ephemeral volume (csi_driver.ephemeral): its backing file is in the pool's
    # ephemeral/ directory, made at its publish and removed with this record at its unpublish.
    ephemeral: bool = False


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    max_volumes_per_node: int


class KeyedLocks:
    """One asyncio.Lock per key, created on demand and dropped when nobody holds or waits on it.

    RPCs on the same volume queue behind each other (a CO retrying a slow mkfs waits for it rather
    than starting a second one); RPCs on different volumes run in parallel.
    """

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


class DriverState:
    def __init__(self, pool_dir: Path, state_dir: Path, *, create_pool: bool = True) -> None:
        """`create_pool`: make a missing pool directory (a shared pool) instead of reporting it
        (a node-local pool is a disk the admin mounts there: made, it would fill another one)."""
        self.pool_dir = pool_dir.resolve()
        self.create_pool = create_pool
        # Why the pool could not be set up at start; "" once it was. Set for good: the controller
        # side was never taken nor the pool reconciled, so a pool that turns up later is used
        # only after a restart (kubelet's, through the livenessprobe's failing Probe).
        self._pool_setup_problem = ""
        self.state_dir = state_dir.resolve()
        self.volume_store = RecordStore(self.state_dir / "volumes", VolumeRecord)
        self.snapshot_store = RecordStore(self.state_dir / "snapshots", SnapshotRecord)
        # A staging record describes loop devices and mounts, which a power loss undoes too; it
        # must outlive the process (a kill -9, which the page cache survives), not the machine,
        # and a stage writes it three or four times: no fsync (reconcile squares it at start), but
        # for the mark of a grow in progress, the one thing only the record knows.
        self.staging_store = RecordStore(self.state_dir / "staging", StagingRecord, durable=False)
        self._volumes: dict[str, VolumeRecord] = {}
        self._snapshots: dict[str, SnapshotRecord] = {}
        self._stagings: dict[str, StagingRecord] = {}
        self.locks = KeyedLocks()
        self._seq = 0
        self.ready = False
        self.not_ready_reason = "state not loaded yet"
        self._state_lock = FileLock(self.state_dir / ".lock")
        self._controller_lock = FileLock(self.pool_dir / ".controller.lock")
        # What every process on the pool takes room from: this one's records and the inline
        # volumes of every node plugin.
        self.budget = PoolBudget(self.pool_dir, self.held_bytes)

    # --- layout ---------------------------------------------------------------------------------
    @property
    def volumes_dir(self) -> Path:
        return self.pool_dir / "volumes"

    @property
    def snapshots_dir(self) -> Path:
        return self.pool_dir / "snapshots"

    @property
    def nodes_dir(self) -> Path:
        return self.pool_dir / "nodes"

    @property
    def ephemeral_dir(self) -> Path:
        return self.pool_dir / "ephemeral"

    @property
    def freezes_dir(self) -> Path:
        return self.pool_dir / "freezes"

    def volume_file(self, volume_id: str) -> str:
        # check_id again here, so no caller can ever build a path from an unchecked id.
        return str(self.volumes_dir / f"{check_id(volume_id, 'volume_id')}.img")

    def ephemeral_file(self, volume_id: str) -> str:
        return str(self.ephemeral_dir / f"{check_id(volume_id, 'volume_id')}.img")

    def backing_file(self, rec: StagingRecord) -> str:
        """The backing file a staging's loop device is bound to."""
        return self.ephemeral_file(rec.volume_id) if rec.ephemeral else self.volume_file(rec.volume_id)

    def snapshot_file(self, snapshot_id: str) -> str:
        return str(self.snapshots_dir / f"{check_id(snapshot_id, 'snapshot_id')}.img")

    # --- load -----------------------------------------------------------------------------------
    def _load(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o700)
        self._volumes = self.volume_store.load()
        self._snapshots = self.snapshot_store.load()
        self._stagings = self.staging_store.load()
        seqs = [v.seq for v in self._volumes.values()] + [s.seq for s in self._snapshots.values()]
        self._seq = max(seqs, default=0)
        self._pool_setup_problem = self._set_up_pool()

    def _set_up_pool(self) -> str:
        """Makes the pool's directories; why the pool is unusable, or "". A node plugin without a
        pool keeps running and says why (Probe, /readyz, GetCapacity 0, CreateVolume refused)
        rather than exiting into a restart loop whose cause only its last log shows."""
        if self.create_pool:
            with contextlib.suppress(OSError):  # what fails is said below, in the pool's terms
                self.pool_dir.mkdir(parents=True, exist_ok=True)
        try:
            if not stat.S_ISDIR(os.stat(self.pool_dir).st_mode):
                return f"--pool-dir {self.pool_dir} is not a directory"
            if not self.create_pool and not self.volumes_dir.is_dir() and (self._volumes or self._snapshots):
                # An empty mount point whose disk is not mounted, not a new pool: what is made in
                # it lands on the file system below and vanishes under the disk once it is mounted,
                # and a delete would forget a volume whose file is still on the disk.
                recorded = len(self._volumes) + len(self._snapshots)
                return (
                    f"--pool-dir {self.pool_dir} has no volumes/ directory, yet --state-dir records "
                    f"{recorded} volume(s) and snapshot(s) in it: is the pool's disk mounted?"
                )
            for d in (
                self.volumes_dir,
                self.snapshots_dir,
                self.nodes_dir,
                self.ephemeral_dir,
                self.freezes_dir,
            ):
                d.mkdir(exist_ok=True)
            # The pool must be writable before Probe says ready. An unnamed file (O_TMPFILE where
            # the filesystem has it, else a unique name unlinked at once) leaves nothing another
            # process sharing the pool could trip over.
            with tempfile.TemporaryFile(dir=self.pool_dir) as probe:
                probe.write(b"ok")
        except FileNotFoundError:
            return f"--pool-dir {self.pool_dir} does not exist"
        except OSError as e:
            return f"--pool-dir {self.pool_dir} is not usable: {e.strerror}"
        return ""

    def _wait_for_lock(self, message: str) -> None:
        self.not_ready_reason = f"waiting for a lock: {message}"
        log.warning("waiting for a lock", holder=message)

    async def load(self) -> None:
        """Takes the state directory (waiting while a previous process on it still exits), then
        reads every record."""
        await self._state_lock.acquire(self._wait_for_lock)
        try:
            await asyncio.to_thread(self._load)
        except OSError as e:
            self.not_ready_reason = f"state {self.state_dir} unusable: {e}"
            raise
        if self._pool_setup_problem:
            log.error("the pool is unusable; serving unhealthy", problem=self._pool_setup_problem)
        log.info(
            "loaded driver state",
            volumes=len(self._volumes),
            snapshots=len(self._snapshots),
            stagings=len(self._stagings),
            pool=str(self.pool_dir),
            state=str(self.state_dir),
        )

    async def take_controller_side(self) -> None:
        """Becomes the pool's one controller: only it creates backing files, and only it may sweep
        the temporary files a killed controller left."""
        await self._controller_lock.acquire(self._wait_for_lock)

    def close(self) -> None:
        self._controller_lock.release()
        self._state_lock.release()

    def pool_problem(self) -> str:
        """What keeps the pool from being used (unusable at start; its directories gone, replaced
        or read-only since), or "" when it is usable. A stat each: cheap enough for every Probe."""
        if self._pool_setup_problem:
            return f"{self._pool_setup_problem}; fix it and restart the plugin"
        for directory in (self.volumes_dir, self.snapshots_dir):
            try:
                if not stat.S_ISDIR(os.lstat(directory).st_mode):
                    return f"pool directory {directory} is not a directory"
            except OSError as e:
                return f"pool directory {directory} is unusable: {e.strerror}"
            if not os.access(directory, os.W_OK):
                return f"pool directory {directory} is not writable"
        return ""

    def health_problem(self) -> str | None:
        """What /readyz reports: the start not finished yet, or a pool the plugin cannot use."""
        if not self.ready:
            return self.not_ready_reason
        return self.pool_problem() or None

    def mark_ready(self) -> None:
        self.ready = True
        self.not_ready_reason = ""

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # --- volumes --------------------------------------------------------------------------------
    def volume(self, volume_id: str) -> VolumeRecord | None:
        """A copy of the volume's record, ready or not; None when there is none."""
        return copy.deepcopy(self._volumes.get(volume_id))

    def volume_by_name(self, name: str) -> VolumeRecord | None:
        return copy.deepcopy(next((v for v in self._volumes.values() if v.name == name), None))

    def list_volumes(self) -> list[VolumeRecord]:
        """Copies of every volume record, in creation order."""
        return [copy.deepcopy(v) for v in sorted(self._volumes.values(), key=lambda v: v.seq)]

    def volume_ids(self) -> set[str]:
        return set(self._volumes)

    def published_count(self, node_id: str) -> int:
        """How many volumes are published to the node."""
        return sum(node_id in v.published for v in self._volumes.values())

    def held_bytes(self, kind: str | None = None) -> int:
        """What every volume and snapshot record holds of the pool (of one pool kind, when
        given), ready or still being made."""
        return sum(v.capacity for v in self._volumes.values() if kind in (None, v.kind)) + sum(
            s.size for s in self._snapshots.values() if kind in (None, s.kind)
        )

    async def put_volume(self, record: VolumeRecord) -> None:
        await self.volume_store.put(record.volume_id, record)
        self._volumes[record.volume_id] = copy.deepcopy(record)

    async def delete_volume(self, volume_id: str) -> None:
        await self.volume_store.delete(volume_id)
        self._volumes.pop(volume_id, None)
        await self.budget.publish()  # the room it held is the pool's again

    # --- snapshots ------------------------------------------------------------------------------
    def snapshot(self, snapshot_id: str) -> SnapshotRecord | None:
        return copy.deepcopy(self._snapshots.get(snapshot_id))

    def snapshot_by_name(self, name: str) -> SnapshotRecord | None:
        return copy.deepcopy(next((s for s in self._snapshots.values() if s.name == name), None))

    def list_snapshots(self) -> list[SnapshotRecord]:
        """Copies of every snapshot record, in creation order."""
        return [copy.deepcopy(s) for s in sorted(self._snapshots.values(), key=lambda s: s.seq)]

    def snapshot_ids(self) -> set[str]:
        return set(self._snapshots)

    async def put_snapshot(self, record: SnapshotRecord) -> None:
        await self.snapshot_store.put(record.snapshot_id, record)
        self._snapshots[record.snapshot_id] = copy.deepcopy(record)

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.snapshot_store.delete(snapshot_id)
        self._snapshots.pop(snapshot_id, None)
        await self.budget.publish()

    # --- stagings (node) ------------------------------------------------------------------------
    def staging(self, volume_id: str) -> StagingRecord | None:
        return copy.deepcopy(self._stagings.get(volume_id))

    def list_stagings(self) -> list[StagingRecord]:
        return [copy.deepcopy(r) for r in self._stagings.values()]

    def staging_count(self) -> int:
        return len(self._stagings)

    async def put_staging(self, record: StagingRecord, *, durable: bool = False) -> None:
        await self.staging_store.put(record.volume_id, record, durable=durable)
        self._stagings[record.volume_id] = copy.deepcopy(record)

    async def delete_staging(self, volume_id: str) -> None:
        await self.staging_store.delete(volume_id)
        self._stagings.pop(volume_id, None)

    # --- nodes ----------------------------------------------------------------------------------
    async def announce_node(self, info: NodeInfo) -> None:
        if self._pool_setup_problem:
            return  # no pool to announce the node in; no controller could find it there either
        doc: dict[str, Any] = {"node_id": info.node_id, "max_volumes_per_node": info.max_volumes_per_node}
        path = self.nodes_dir / f"{check_id(info.node_id, 'node id')}.json"
        await asyncio.to_thread(write_json_atomic, path, doc)

    def known_node(self, node_id: str) -> NodeInfo | None:
        """A node plugin that announced itself in the pool; None for a node the pool never saw."""
        try:
            check_id(node_id, "node_id")
        except CsiError:
            return None
        try:
            doc = json.loads((self.nodes_dir / f"{node_id}.json").read_text())
        except (OSError, ValueError):
            return None
        return NodeInfo(
            node_id=str(doc["node_id"]), max_volumes_per_node=int(doc.get("max_volumes_per_node", 0))
        )
