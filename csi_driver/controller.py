"""The CSI Controller service: backing files in the pool, snapshots, and which node a volume is
published to. It never touches loop devices or mounts; that is the node service's job."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from controller_runtime.files import is_temp_name
from controller_runtime.logs import get_logger
from controller_runtime.storage import ANN_ALLOW_VOLUME_MODE_CHANGE
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from . import TOPOLOGY_KEY, mutable
from .backend import files
from .backend.fs import DEFAULT_FS, SUPPORTED
from .capabilities import (
    SINGLE_NODE_MODES,
    Capability,
    malformed_reason,
    parse_capability,
    unsupported_reason,
)
from .errors import (
    CsiError,
    aborted,
    already_exists,
    exhausted,
    failed_precondition,
    invalid,
    not_found,
    out_of_range,
    unimplemented,
)
from .mutable import check_mutable
from .pool_kinds import KIND_PARAMETER, PoolCapacity, chosen_kind
from .state import DriverState, SnapshotRecord, VolumeRecord
from .topology import checked_requirements, local_topology, names_node
from .transfer.client import discard as discard_part
from .validation import (
    MIN_UNIT,
    SIZE_UNIT,
    check_id,
    check_name,
    choose_size,
    fits,
    format_size,
    paginate,
    round_down,
)

if TYPE_CHECKING:
    from .transfer.access import PeerAccess

log = get_logger("csi.controller")

# A half-made restore or clone pulled from a peer stays this long across restarts of its puller
# for the CO's retry to resume it (_resumable); after it, the next start rolls it back.
PULL_KEPT_SECONDS = 3600.0

RPC = csi_pb2.ControllerServiceCapability.RPC
CAPABILITIES = (
    RPC.CREATE_DELETE_VOLUME,
    RPC.PUBLISH_UNPUBLISH_VOLUME,
    RPC.LIST_VOLUMES,
    RPC.LIST_VOLUMES_PUBLISHED_NODES,
    RPC.GET_CAPACITY,
    RPC.EXPAND_VOLUME,
    RPC.CLONE_VOLUME,
    RPC.CREATE_DELETE_SNAPSHOT,
    RPC.LIST_SNAPSHOTS,
    RPC.GET_SNAPSHOT,
    RPC.GET_VOLUME,
    RPC.VOLUME_CONDITION,
    RPC.SINGLE_NODE_MULTI_WRITER,
    RPC.PUBLISH_READONLY,
    RPC.MODIFY_VOLUME,
)
# What only a published volume has: a node-local pool's volumes are never ControllerPublished
# (attachRequired: false), as csi-driver-host-path's without --enable-attach.
PUBLISHING = frozenset({RPC.PUBLISH_UNPUBLISH_VOLUME, RPC.LIST_VOLUMES_PUBLISHED_NODES, RPC.PUBLISH_READONLY})

FSTYPE_PARAMETERS = ("csi.storage.k8s.io/fstype", "fsType")
# A copy (restore or clone) may have another access type than its source only when the request
# says so with this parameter, "true": kubeloop's external-provisioner passes it from the
# VolumeSnapshotContent's annotation of the same key; an admin may set it in a StorageClass.
MODE_CHANGE_PARAMETER = ANN_ALLOW_VOLUME_MODE_CHANGE
# external-provisioner passes its own metadata (pvc name, namespace, ...) under this prefix.
PROVISIONER_PREFIX = "csi.storage.k8s.io/"

# publish_context keys, read by the node service.
CTX_BACKING_FILE = "loop.csi.kubeloop.dev/backing-file"
CTX_READONLY = "loop.csi.kubeloop.dev/readonly"
CTX_FS_TYPE = "fsType"
CTX_ACCESS_TYPE = "loop.csi.kubeloop.dev/access-type"


@dataclass(frozen=True)
class ControllerConfig:
    max_volume_size: int
    capacity: PoolCapacity  # nothing configured: the pool filesystem's free space is the capacity
    local_node_id: str = ""  # in --mode all, the node served by this same process
    # --node-local: the pool is local_node_id's alone, so are the volumes made in it (their
    # topology is that node only) and the sources a clone or restore can copy.
    node_local: bool = False
    # The key of the topology segments it reads and writes (follows --drivername).
    topology_key: str = TOPOLOGY_KEY
    # --transfer-port: pulls and moves between node-local pools (csi_driver.transfer).
    transfers: bool = False


def part_of(name: str) -> str:
    """The volume id whose pull a pool file belongs to (csi_driver.transfer.client's part and
    progress files beside the volume's), or ""."""
    for suffix in (".img.part", ".img.part.progress"):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return ""


def _timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


@dataclass(frozen=True)
class _Source:
    """What a CreateVolume copies: none (kind ""), a snapshot or a volume."""

    kind: str = ""
    id: str = ""
    path: str = ""
    size: int = 0
    access_type: str = ""  # what the source holds; "" for snapshots older than these fields
    fs_type: str = ""
    node: str = ""  # node-local: the peer whose pool holds it ("" when this pool does)


def _mode_change_granted(params: Mapping[str, str]) -> bool:
    value = params.get(MODE_CHANGE_PARAMETER, "false")
    if value not in ("true", "false"):
        raise invalid(f'parameter {MODE_CHANGE_PARAMETER} must be "true" or "false", not {value!r}')
    return value == "true"


def _incompatible_source(source: _Source, access_type: str, fs_type: str, mode_change: bool) -> str | None:
    """Why a volume of `access_type`/`fs_type` cannot be made from `source`, else None. A copy
    keeps its source's access type unless the request grants a change (`mode_change`): a
    filesystem read as a raw device shows every byte of it, deleted files and metadata included,
    and raw block data mounted as a filesystem hands the node's kernel an image its user wrote
    (KEP-3141). A source recorded before access types were ("") is let through."""
    grant = f'; the request may change it only with the parameter {MODE_CHANGE_PARAMETER}: "true"'
    if source.access_type == "mount" and access_type == "block" and not mode_change:
        return f"holds a filesystem ({source.fs_type or 'of unknown type'}), not a block volume{grant}"
    if source.access_type == "block" and access_type == "mount" and not mode_change:
        return f"holds raw block data, not a filesystem; restore it as a block volume{grant}"
    if (
        source.access_type == "mount"
        and access_type == "mount"
        and source.fs_type
        and source.fs_type != fs_type
    ):
        return f"holds a {source.fs_type} filesystem, not {fs_type}; a copy keeps its filesystem"
    return None


def _mismatch(vol: VolumeRecord, wanted: VolumeRecord, required: int, limit: int) -> list[str]:
    """How an existing volume of a CreateVolume's name differs from what the repeat asks for."""
    mismatch = []
    if not fits(vol.capacity, required, limit):
        mismatch.append(f"capacity {vol.capacity} is outside the requested range")
    if (vol.source_kind, vol.source_id) != (wanted.source_kind, wanted.source_id):
        mismatch.append("content source differs")
    if vol.access_type != wanted.access_type:
        mismatch.append(f"it is a {vol.access_type} volume")
    if vol.fs_type != wanted.fs_type:
        mismatch.append(f"its filesystem is {vol.fs_type or 'none'}")
    if vol.kind != wanted.kind:
        mismatch.append(f"its pool kind is {vol.kind or 'none'}")
    if wanted.topology and vol.topology and not any(t in vol.topology for t in wanted.topology):
        mismatch.append("it is not accessible from the requested topology")
    return mismatch


def publish_context(vol: VolumeRecord, readonly: bool) -> dict[str, str]:
    """What the node service needs of a volume it stages: ControllerPublishVolume hands it to the
    CO; a node-local node plugin, never published (attachRequired: false), reads it from its own
    record of the volume instead."""
    return {
        CTX_BACKING_FILE: f"volumes/{vol.volume_id}.img",
        CTX_READONLY: "true" if readonly else "false",
        CTX_ACCESS_TYPE: vol.access_type,
        **({CTX_FS_TYPE: vol.fs_type} if vol.fs_type else {}),
    }


def _access_type(caps: Iterable[Capability]) -> str:
    kinds = {c.access_type for c in caps}
    if len(kinds) > 1:
        raise invalid("volume_capabilities mix mount and block; a volume is one or the other")
    return kinds.pop()


class ControllerServer(csi_pb2_grpc.ControllerServicer):  # type: ignore[misc]
    def __init__(self, state: DriverState, config: ControllerConfig, peers: PeerAccess | None = None) -> None:
        self.state = state
        self.config = config
        # Node-local with transfers on (--transfer-port): a source in another node's pool is
        # pulled from there (csi_driver.transfer) instead of refused.
        self.peers = peers
        self._pulls: dict[str, asyncio.Task[object]] = {}
        # A record is what reserves room in the pool. The room check and the write of the record
        # that takes the room run under the pool's budget (csi_driver.budget: a lock shared with
        # the node plugins, whose inline volumes take from the same --capacity), so concurrent
        # creates, clones, snapshots, expansions and inline volumes never count the same free bytes.
        state.budget.serve(config.capacity)
        self.holds_pool = False  # whether reconcile took the pool's controller side

    # --- start-up -------------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Takes the pool's controller side, then compares the records with the pool: leftovers of
        interrupted copies go, and a volume whose backing file vanished is reported (its condition
        turns abnormal), never invented. Without a usable pool there is nothing to compare: the
        driver serves unhealthy (Probe, /readyz) and refuses every create until it is restarted on
        one."""
        if problem := self.state.pool_problem():
            log.error("the pool is unusable; no volume can be created", problem=problem)
            return
        await self.state.take_controller_side()
        self.holds_pool = True

        def scan() -> tuple[set[str], set[str]]:
            names: dict[str, set[str]] = {"volumes": set(), "snapshots": set()}
            for kind, directory in (
                ("volumes", self.state.volumes_dir),
                ("snapshots", self.state.snapshots_dir),
            ):
                for entry in os.scandir(directory):
                    if is_temp_name(entry.name):  # we hold the pool's controller lock
                        os.unlink(entry.path)
                    elif (pulled := part_of(entry.name)) and self.state.volume(pulled) is None:
                        os.unlink(entry.path)  # a pull whose volume is gone: nothing resumes it
                    elif entry.name.endswith(".img"):
                        names[kind].add(entry.name.removesuffix(".img"))
            return names["volumes"], names["snapshots"]

        # A record that is not ready belongs to a CreateVolume or CreateSnapshot that never
        # answered (killed mid-copy): no CO knows its id, so it is rolled back, file and record,
        # and the CO's retry by name makes it anew. Listing it instead would show a volume no
        # claim can own; finishing it would spend the pool on a name that may never be retried.
        half_made: list[VolumeRecord | SnapshotRecord] = [
            *(v for v in self.state.list_volumes() if not v.ready and not self._resumable(v)),
            *(s for s in self.state.list_snapshots() if not s.ready),
        ]
        for record in half_made:
            await self._roll_back(record)
        if not self.config.transfers:
            # Transfers turned off with a move under way: nothing would ever end it, and a
            # released volume could never be staged again. The move's marks go; a complete copy a
            # move brought in stays (its PV may have switched to it), a half-made one went above.
            for vol in self.state.list_volumes():
                if vol.incoming_from or vol.leaving_to:
                    await self.state.put_volume(
                        dataclasses.replace(vol, leaving_to="", incoming_from="", move_pv="")
                    )
                    log.warning(
                        "a move was left unfinished (transfers are off); this copy stays",
                        volume=vol.volume_id,
                    )
        # Tells the node plugins on this pool the --capacity and what the records hold, before any
        # of them counts on a budget file a previous controller (maybe with other flags) wrote.
        await self.state.budget.publish()
        volume_files, snapshot_files = await asyncio.to_thread(scan)
        for vol in self.state.list_volumes():
            if vol.volume_id not in volume_files:
                log.error("backing file of a volume is missing", volume=vol.volume_id, name=vol.name)
        for snap in self.state.list_snapshots():
            if snap.snapshot_id not in snapshot_files:
                log.error("backing file of a snapshot is missing", snapshot=snap.snapshot_id, name=snap.name)
        for orphan in sorted(volume_files - self.state.volume_ids()):
            log.warning("backing file without a volume record; leaving it for an operator", volume=orphan)
        for orphan in sorted(snapshot_files - self.state.snapshot_ids()):
            log.warning("backing file without a snapshot record; leaving it for an operator", snapshot=orphan)

    def _resumable(self, vol: VolumeRecord) -> bool:
        """A half-made volume kept across a restart, for its pull to resume rather than start over:
        one a move brings in (the move decides its fate, csi_driver.transfer.moves), or a recent
        restore or clone from a peer (the CO's retry by name resumes it; one never retried goes
        at a start after PULL_KEPT_SECONDS)."""
        if not self.config.transfers:
            return False  # nothing would ever finish it
        if vol.incoming_from:
            return True
        return bool(vol.source_node) and time.time() - vol.created_at < PULL_KEPT_SECONDS

    # --- helpers --------------------------------------------------------------------------------
    async def _roll_back(self, record: VolumeRecord | SnapshotRecord) -> None:
        """Removes a volume or snapshot that was never handed to a CO: backing file first, then
        the record. Failing here is logged, not raised: the caller's own error is the answer, and
        the next start rolls the record back again."""
        try:
            if isinstance(record, VolumeRecord):
                path = self.state.volume_file(record.volume_id)
                await asyncio.to_thread(discard_part, path)
                await asyncio.to_thread(files.remove, path)
                await self.state.delete_volume(record.volume_id)
                log.info("rolled back a half-made volume", volume=record.volume_id, name=record.name)
            else:
                await asyncio.to_thread(files.remove, self.state.snapshot_file(record.snapshot_id))
                await self.state.delete_snapshot(record.snapshot_id)
                log.info("rolled back a half-made snapshot", snapshot=record.snapshot_id, name=record.name)
        except OSError as e:
            log.error("could not roll back; the next start tries again", name=record.name, error=str(e))

    async def sweep_stale_pulls(self) -> None:
        """Rolls back the half-made restores and clones from a peer that no CO came back for
        (their claim deleted while the pull was cut, say) once PULL_KEPT_SECONDS have passed: the
        room they hold is the pool's again. A pull under way is left alone."""
        for vol in self.state.list_volumes():
            stale = time.time() - vol.created_at >= PULL_KEPT_SECONDS
            if (
                vol.ready
                or not vol.source_node
                or vol.incoming_from
                or not stale
                or vol.volume_id in self._pulls
            ):
                continue
            async with self.state.locks.hold(vol.volume_id):
                if (current := self.state.volume(vol.volume_id)) is not None and not current.ready:
                    await self._roll_back(current)

    # --- moves (csi_driver.transfer.moves) -----------------------------------------------------
    async def receive(self, wanted: VolumeRecord) -> VolumeRecord:
        """The record of a volume a move brings in under its own id, made (not ready, taking its
        room in this pool) unless it is there already."""
        async with self.state.locks.hold(wanted.volume_id):
            vol = self.state.volume(wanted.volume_id)
            if vol is not None:
                return vol
            async with self._reserving(wanted.capacity, wanted.kind):
                vol = dataclasses.replace(wanted, seq=self.state.next_seq())
                await self.state.put_volume(vol)
            return vol

    async def drop_copy(self, volume_id: str, why: str) -> None:
        """Removes this pool's copy of a volume that another node's pool now serves (or never
        will: a cancelled move's pull), what was pulled of it included."""
        async with self.state.locks.hold(volume_id):
            vol = self.state.volume(volume_id)
            if vol is None:
                return
            if self.state.staging(volume_id) is not None:
                raise failed_precondition(f"volume {volume_id} is staged on node {self.config.local_node_id}")
            path = self.state.volume_file(volume_id)
            await asyncio.to_thread(discard_part, path)
            await asyncio.to_thread(files.remove, path)
            await self.state.delete_volume(volume_id)
        log.info("dropped this pool's copy of a volume", volume=volume_id, why=why)

    def _refuse_moving(self, vol: VolumeRecord, what: str) -> None:
        """A volume a move has released here, or is bringing here, is left as it is until the move
        ends or is cancelled: a change to one copy would be lost with it or missing in the other."""
        if vol.leaving_to or vol.incoming_from:
            there = vol.leaving_to or vol.incoming_from
            raise aborted(
                f"volume {vol.volume_id} is being moved between node {self.config.local_node_id} and node "
                f"{there} (kubectl kubeloop move); it can be {what} once the move ends or is cancelled"
            )

    def _volume(self, volume_id: str) -> VolumeRecord:
        check_id(volume_id, "volume_id")
        vol = self.state.volume(volume_id)
        if vol is None or not vol.ready:
            raise not_found(f"volume {volume_id} does not exist")
        return vol

    def _pool_owner(self) -> str:
        return f"the pool of node {self.config.local_node_id}" if self.config.node_local else "the pool"

    @contextlib.asynccontextmanager
    async def _reserving(self, size: int, kind: str) -> AsyncIterator[None]:
        """Checks that `size` more bytes of `kind` fit, and holds the pool's budget while the
        caller writes the record that takes them."""
        budget = self.state.budget
        async with budget.deciding():
            await self._check_room(size, kind)
            async with budget.holding(size, kind):
                yield

    async def _check_room(self, size: int, kind: str) -> None:
        room = await self.state.budget.room(kind)
        available = room.left
        if size > available:
            if self.config.capacity.kinds and kind not in self.config.capacity.kinds:
                where = f"pool kind {kind or '(none)'}, which --capacity no longer configures"
            elif kind:
                where = f"pool kind {kind} (--capacity {kind}=...)"
            elif self.config.capacity.total:
                where = "configured --capacity"
            else:
                where = f"pool filesystem {self.state.pool_dir}"
            if room.inline:
                where += f" (inline ephemeral volumes hold {format_size(room.inline)} of it)"
            raise exhausted(
                f"not enough space for {format_size(size)}: {available} bytes are free in the {where}"
            )

    def _fs_type(self, params: dict[str, str], caps: list[Capability]) -> str:
        """The filesystem a request names (parameters or capabilities); "" when it names none."""
        accepted = (*FSTYPE_PARAMETERS, KIND_PARAMETER, MODE_CHANGE_PARAMETER)
        unknown = sorted(k for k in params if k not in accepted and not k.startswith(PROVISIONER_PREFIX))
        if unknown:
            raise invalid(
                f"unknown parameters {', '.join(unknown)}; this driver accepts {', '.join(accepted)}"
            )
        from_params = next((params[k] for k in FSTYPE_PARAMETERS if params.get(k)), "")
        if from_params and from_params not in SUPPORTED:
            raise invalid(f"filesystem {from_params!r} is not supported; use one of {', '.join(SUPPORTED)}")
        requested = {c.fs_type for c in caps if c.fs_type}
        if from_params:
            requested.add(from_params)
        if len(requested) > 1:
            raise invalid(f"conflicting filesystem types requested: {', '.join(sorted(requested))}")
        return requested.pop() if requested else ""

    def _topology(self, req: csi_pb2.CreateVolumeRequest) -> list[dict[str, str]]:
        """Every node plugin that shares this pool can attach a volume's backing file, so a volume
        is accessible from each requested node the pool knows (the preferred one first); a node
        the pool never saw can't stage it. Without requirements it is reachable from every node.
        A node-local pool is its node's alone: the volume is accessible from that node only."""
        reqs = checked_requirements(req)
        if self.config.node_local:
            return local_topology(reqs, self.config.local_node_id, self.config.topology_key)
        if reqs is None:
            return []
        key = self.config.topology_key
        named: list[str] = []
        for segment in [*reqs.preferred, *reqs.requisite]:
            node = segment.segments.get(key)
            if node and node not in named:
                named.append(node)
        reachable = [n for n in named if self.state.known_node(n) is not None]
        if reachable:
            return [{key: n} for n in reachable]
        if named:
            # No node plugin has announced itself yet: keep the preferred node, as a local volume.
            return [{key: named[0]}]
        if reqs.requisite:
            raise exhausted(f"no requisite topology segment names a node with key {key}")
        return []

    def _csi_volume(self, vol: VolumeRecord) -> csi_pb2.Volume:
        source = None
        if vol.source_kind == "snapshot":
            source = csi_pb2.VolumeContentSource(
                snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=vol.source_id)
            )
        elif vol.source_kind == "volume":
            source = csi_pb2.VolumeContentSource(
                volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=vol.source_id)
            )
        context = {CTX_FS_TYPE: vol.fs_type} if vol.access_type == "mount" else {}
        return csi_pb2.Volume(
            volume_id=vol.volume_id,
            capacity_bytes=vol.capacity,
            volume_context=context,
            content_source=source,
            accessible_topology=[csi_pb2.Topology(segments=t) for t in vol.topology],
        )

    def _condition(self, vol: VolumeRecord) -> csi_pb2.VolumeCondition:
        try:
            st = os.lstat(self.state.volume_file(vol.volume_id))
        except OSError as e:
            return csi_pb2.VolumeCondition(abnormal=True, message=f"backing file unavailable: {e.strerror}")
        if not stat.S_ISREG(st.st_mode):
            return csi_pb2.VolumeCondition(abnormal=True, message="backing file is not a regular file")
        size = st.st_size
        if size < vol.capacity:
            return csi_pb2.VolumeCondition(
                abnormal=True,
                message=f"backing file is {size} bytes, smaller than the volume's {vol.capacity}",
            )
        return csi_pb2.VolumeCondition(abnormal=False, message="backing file present")

    async def _fill(self, path: str, size: int, source: str | None) -> None:
        try:
            if source is None:
                await asyncio.to_thread(files.create_sparse, path, size)
            else:
                await asyncio.to_thread(files.copy_sparse, source, path, size)
        except OSError as e:
            await asyncio.to_thread(files.remove, path)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise exhausted(f"the pool {self.state.pool_dir} is full: {e.strerror}") from e
            raise

    # --- volumes --------------------------------------------------------------------------------
    async def _source(self, req: csi_pb2.CreateVolumeRequest) -> _Source:
        """The snapshot or volume a CreateVolume copies, checked to exist and be complete: in this
        pool, or (node-local with transfers) in a peer's."""
        if not req.HasField("volume_content_source"):
            return _Source()
        src = req.volume_content_source
        record: VolumeRecord | SnapshotRecord | None
        if src.HasField("snapshot"):
            kind, source_id = "snapshot", check_id(src.snapshot.snapshot_id, "source snapshot_id")
            record, path = self.state.snapshot(source_id), self.state.snapshot_file(source_id)
        elif src.HasField("volume"):
            kind, source_id = "volume", check_id(src.volume.volume_id, "source volume_id")
            record, path = self.state.volume(source_id), self.state.volume_file(source_id)
        else:
            raise invalid("volume_content_source must name a snapshot or a volume")
        if isinstance(record, VolumeRecord) and record.incoming_from:
            record = None  # a move's copy is not the volume until the move switches to it
        if (record is None or not record.ready) and self.peers is not None:
            half_made = self.state.volume_by_name(req.name)
            if half_made is not None and half_made.source_node and half_made.source_id == source_id:
                # A retry of a pull under way: its source is where it was found, not asked again.
                return _Source(
                    kind, source_id, "", half_made.capacity, half_made.access_type, half_made.fs_type,
                    half_made.source_node,
                )  # fmt: skip
            located = await self.peers.locate(kind, source_id)
            info = located.info
            return _Source(kind, source_id, "", info.size, info.access_type, info.fs_type, located.node)
        if record is None or not record.ready:
            if self.config.node_local:
                raise not_found(
                    f"source {kind} {source_id} is not in the pool of node {self.config.local_node_id}: "
                    "node-local volumes are cloned and restored on the node that holds the source"
                )
            raise not_found(f"source {kind} {source_id} does not exist")
        size = record.size if isinstance(record, SnapshotRecord) else record.capacity
        return _Source(kind, source_id, path, size, record.access_type, record.fs_type)

    async def _make(self, vol: VolumeRecord, source: _Source) -> VolumeRecord:
        """Fills the backing file of a recorded volume and marks it ready; a failure rolls it back."""
        async with self.state.locks.hold(vol.volume_id):
            try:
                if source.node:
                    await self._pulled(vol, source)
                elif source.path:
                    # Holding the source's lock keeps it from being deleted or grown mid-copy; what
                    # was read of it before the lock is read again under it.
                    async with self.state.locks.hold(source.id):
                        self._check_source_again(source, vol.capacity)
                        await self._fill(self.state.volume_file(vol.volume_id), vol.capacity, source.path)
                else:
                    await self._fill(self.state.volume_file(vol.volume_id), vol.capacity, None)
                # A copy starts with the attributes of a new file, whatever its source had.
                path = self.state.volume_file(vol.volume_id)
                await asyncio.to_thread(mutable.apply, path, vol.mutable_parameters)
                vol.ready = True
                await self.state.put_volume(vol)
            except Exception as e:
                if source.node and isinstance(e, CsiError) and e.code is grpc.StatusCode.UNAVAILABLE:
                    # A cut stream or an absent peer: the record and what was pulled stay, and
                    # the CO's retry resumes the pull where it stopped.
                    raise
                # A failed fill (a full pool, an unreadable source) gives the room back at once.
                # A call cancelled by the driver stopping is not: its copy may still be running in
                # a thread, and the next start rolls the record back.
                await self._roll_back(vol)
                raise
        return vol

    async def _pulled(self, vol: VolumeRecord, source: _Source) -> None:
        """Pulls a peer's source into the volume's file. The pull is this process's, not the call's:
        a CreateVolume cut by its deadline leaves it running, and the retry waits for the same pull
        (a large volume would otherwise start over, or from its last durable point, at every try)."""
        assert self.peers is not None
        pull = self._pulls.get(vol.volume_id)
        if pull is None:
            path = self.state.volume_file(vol.volume_id)
            pull = asyncio.create_task(
                self.peers.pull(source.node, source.kind, source.id, path, vol.capacity)
            )
            self._pulls[vol.volume_id] = pull
            pull.add_done_callback(lambda _: self._pulls.pop(vol.volume_id, None))
        await asyncio.shield(pull)

    def _check_source_again(self, source: _Source, capacity: int) -> None:
        """Under the source's lock: it still exists, and still fits the volume being made (an
        expansion may have grown it since it was first read)."""
        record = self.state.snapshot(source.id) if source.kind == "snapshot" else self.state.volume(source.id)
        if record is None or not record.ready:
            raise not_found(f"source {source.kind} {source.id} does not exist")
        size = record.size if isinstance(record, SnapshotRecord) else record.capacity
        if size > capacity:
            raise out_of_range(
                f"the {source.kind} {source.id} holds {format_size(size)}, more than the volume's "
                f"{format_size(capacity)}"
            )

    async def CreateVolume(
        self, req: csi_pb2.CreateVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.CreateVolumeResponse:
        name = check_name(req.name)
        if not req.volume_capabilities:
            raise invalid("volume_capabilities are required")
        caps = [parse_capability(c, "volume_capabilities") for c in req.volume_capabilities]
        access_type = _access_type(caps)
        requested_fs = self._fs_type(dict(req.parameters), caps) if access_type == "mount" else ""
        kind = chosen_kind(req.parameters, self.config.capacity)
        mutable_parameters = check_mutable(req.mutable_parameters)
        required, limit = req.capacity_range.required_bytes, req.capacity_range.limit_bytes
        if req.HasField("capacity_range") and not required and not limit:
            raise invalid("capacity_range must set required_bytes or limit_bytes, or be unset")
        topology = self._topology(req)
        if problem := await asyncio.to_thread(self.state.pool_problem):
            # RESOURCE_EXHAUSTED, as for a full pool: there is no room here at all, and it is the
            # one code the external-provisioner answers by rescheduling a WaitForFirstConsumer
            # claim to another node instead of retrying this one forever.
            raise exhausted(f"{self._pool_owner()} cannot hold volumes: {problem}")
        source = await self._source(req)
        # A copy of a filesystem keeps its filesystem unless the request names another, which the
        # copy cannot be: the node would refuse to stage it, so the create refuses it now.
        mount = access_type == "mount"
        fs_type = requested_fs or (source.fs_type if mount else "") or (DEFAULT_FS if mount else "")
        mode_change = _mode_change_granted(req.parameters)
        if (reason := _incompatible_source(source, access_type, fs_type, mode_change)) is not None:
            raise invalid(f"the {source.kind} {source.id} {reason}")
        if source.size and not required and not limit:
            size = source.size
        else:
            size = choose_size(required, limit, self.config.max_volume_size)
        if size < source.size:
            raise out_of_range(
                f"the {source.kind} {source.id} holds {format_size(source.size)}, more than the requested "
                f"capacity of at most {format_size(size)}"
            )
        wanted = VolumeRecord(
            volume_id=f"vol-{uuid.uuid4().hex}",
            name=name,
            capacity=size,
            seq=0,
            access_type=access_type,
            fs_type=fs_type,
            parameters=dict(req.parameters),
            source_kind=source.kind,
            source_id=source.id,
            source_node=source.node,
            topology=topology,
            kind=kind,
            mutable_parameters=mutable_parameters,
        )
        async with self.state.locks.hold(f"name/{name}"):
            vol = self.state.volume_by_name(name)
            if vol is not None:
                if mismatch := _mismatch(vol, wanted, required, limit):
                    raise already_exists(
                        f"a volume named {name!r} already exists ({vol.volume_id}) and is incompatible: "
                        + "; ".join(mismatch)
                    )
                if vol.ready:
                    return csi_pb2.CreateVolumeResponse(volume=self._csi_volume(vol))
                log.info("resuming an interrupted CreateVolume", volume=vol.volume_id, name=name)
            else:
                async with self._reserving(size, kind):
                    # The record goes first (not ready): it holds the room, and after a crash
                    # before the file is complete it tells the restarted controller what to roll
                    # back (no CO can know a volume whose CreateVolume never answered).
                    vol = dataclasses.replace(wanted, seq=self.state.next_seq())
                    await self.state.put_volume(vol)
            vol = await self._make(vol, source)
        log.info(
            "created volume",
            volume=vol.volume_id,
            name=name,
            size=vol.capacity,
            access_type=access_type,
            source=f"{source.kind}:{source.id}" if source.kind else "",
        )
        return csi_pb2.CreateVolumeResponse(volume=self._csi_volume(vol))

    async def DeleteVolume(
        self, req: csi_pb2.DeleteVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.DeleteVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        async with self.state.locks.hold(volume_id):
            vol = self.state.volume(volume_id)
            if vol is None:
                return csi_pb2.DeleteVolumeResponse()
            if vol.published:
                raise failed_precondition(
                    f"volume {volume_id} is still published to node(s) {', '.join(sorted(vol.published))}; "
                    "unpublish it first"
                )
            self._refuse_moving(vol, "deleted")
            if self.config.node_local and self.state.staging(volume_id) is not None:
                # Never published (attachRequired: false), so the staging is what says it is in
                # use: its loop device still holds the backing file.
                node = self.config.local_node_id
                raise failed_precondition(
                    f"volume {volume_id} is still staged on node {node}; unstage it first"
                )
            if problem := await asyncio.to_thread(self.state.pool_problem):
                # Its backing file may well exist where the pool should be (a disk not mounted):
                # the record is kept, so the retry once the pool is back deletes the file.
                raise failed_precondition(f"volume {volume_id} cannot be deleted now: {problem}")
            # File first, record last: a crash in between leaves a record whose retry deletes nothing.
            await asyncio.to_thread(discard_part, self.state.volume_file(volume_id))
            await asyncio.to_thread(files.remove, self.state.volume_file(volume_id))
            await self.state.delete_volume(volume_id)
        log.info("deleted volume", volume=volume_id, name=vol.name)
        return csi_pb2.DeleteVolumeResponse()

    def _refuse_publish(self, rpc: str) -> None:
        if self.config.node_local:
            raise unimplemented(
                f"{rpc} is not supported with --node-local: the node stages its own pool's volumes "
                "unpublished (CSIDriver attachRequired: false)"
            )

    async def ControllerPublishVolume(
        self, req: csi_pb2.ControllerPublishVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerPublishVolumeResponse:
        self._refuse_publish("ControllerPublishVolume")
        volume_id = check_id(req.volume_id, "volume_id")
        if not req.node_id:
            raise invalid("node_id is required")
        if not req.HasField("volume_capability"):
            raise invalid("volume_capability is required")
        cap = parse_capability(req.volume_capability)
        async with self.state.locks.hold(volume_id):
            vol = self._volume(volume_id)
            node_id = req.node_id
            node = self.state.known_node(node_id)
            if node is None and node_id != self.config.local_node_id:
                raise not_found(
                    f"node {node_id} is unknown: no node plugin with that --node-id uses this pool"
                )
            key = self.config.topology_key
            if vol.topology and all(t.get(key) != node_id for t in vol.topology):
                raise failed_precondition(
                    f"volume {volume_id} is only accessible from nodes "
                    f"{', '.join(t.get(key, '?') for t in vol.topology)}"
                )
            readonly = req.readonly
            existing = vol.published.get(node_id)
            if existing is not None and existing != readonly:
                raise already_exists(
                    f"volume {volume_id} is already published to node {node_id} with readonly={existing}"
                )
            if existing is not None and cap.access_type != vol.access_type:
                raise already_exists(
                    f"volume {volume_id} is already published to node {node_id} as a {vol.access_type} "
                    f"volume, not {cap.access_type}"
                )
            if existing is None:
                others = sorted(n for n in vol.published if n != node_id)
                # Either side single-node: a second node must not mount what the first holds alone
                # (a reader's "ro" mount of ext4 or xfs still replays the writer's live journal).
                exclusive = [n for n in others if vol.published_modes.get(n) in SINGLE_NODE_MODES]
                if others and (cap.single_node or exclusive):
                    holder = exclusive[0] if exclusive else others[0]
                    mode = vol.published_modes.get(holder, cap.mode) if exclusive else cap.mode
                    raise failed_precondition(
                        f"volume {volume_id} has single-node access mode "
                        f"{csi_pb2.VolumeCapability.AccessMode.Mode.Name(mode)} and is already published "
                        f"to node {holder}"
                    )
                limit = node.max_volumes_per_node if node is not None else 0
                # The count and the record that raises it under the node's lock (taken after the
                # volume's, never before): publishes of different volumes to one node run at once.
                async with self.state.locks.hold(f"node/{node_id}"):
                    if limit and self.state.published_count(node_id) >= limit:
                        raise exhausted(
                            f"node {node_id} already has its maximum of {limit} volumes published"
                        )
                    vol.published[node_id] = readonly
                    vol.published_modes[node_id] = cap.mode
                    await self.state.put_volume(vol)
                log.info("published volume", volume=volume_id, node=node_id, readonly=readonly)
        return csi_pb2.ControllerPublishVolumeResponse(publish_context=publish_context(vol, readonly))

    async def ControllerUnpublishVolume(
        self, req: csi_pb2.ControllerUnpublishVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerUnpublishVolumeResponse:
        self._refuse_publish("ControllerUnpublishVolume")
        volume_id = check_id(req.volume_id, "volume_id")
        async with self.state.locks.hold(volume_id):
            vol = self.state.volume(volume_id)
            if vol is not None:
                # An empty node_id means "from every node" (CSI spec).
                nodes = [req.node_id] if req.node_id else list(vol.published)
                if any(n in vol.published for n in nodes):
                    for n in nodes:
                        vol.published.pop(n, None)
                        vol.published_modes.pop(n, None)
                    await self.state.put_volume(vol)
                    log.info("unpublished volume", volume=volume_id, nodes=",".join(nodes))
        return csi_pb2.ControllerUnpublishVolumeResponse()

    async def ValidateVolumeCapabilities(
        self, req: csi_pb2.ValidateVolumeCapabilitiesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ValidateVolumeCapabilitiesResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        if not req.volume_capabilities:
            raise invalid("volume_capabilities are required")
        for cap in req.volume_capabilities:
            if (malformed := malformed_reason(cap)) is not None:
                raise invalid(f"volume_capabilities: {malformed}")
        vol = self._volume(volume_id)
        for cap in req.volume_capabilities:
            reason = unsupported_reason(cap)
            if reason is None and vol.access_type == "block" and cap.HasField("mount"):
                reason = f"volume {volume_id} is a block volume, not a filesystem"
            if (
                reason is None
                and cap.HasField("mount")
                and cap.mount.fs_type
                and vol.fs_type
                and (cap.mount.fs_type != vol.fs_type)
            ):
                reason = f"volume {volume_id} is formatted as {vol.fs_type}, not {cap.mount.fs_type}"
            if reason is not None:
                return csi_pb2.ValidateVolumeCapabilitiesResponse(message=reason)
        return csi_pb2.ValidateVolumeCapabilitiesResponse(
            confirmed=csi_pb2.ValidateVolumeCapabilitiesResponse.Confirmed(
                volume_context=req.volume_context,
                volume_capabilities=req.volume_capabilities,
                parameters=req.parameters,
            )
        )

    async def ListVolumes(
        self, req: csi_pb2.ListVolumesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ListVolumesResponse:
        vols = [(v.seq, v) for v in self.state.list_volumes() if v.ready]
        page = paginate(vols, req.starting_token, req.max_entries)
        return csi_pb2.ListVolumesResponse(
            entries=[
                csi_pb2.ListVolumesResponse.Entry(
                    volume=self._csi_volume(v),
                    status=csi_pb2.ListVolumesResponse.VolumeStatus(
                        published_node_ids=sorted(v.published), volume_condition=self._condition(v)
                    ),
                )
                for v in page.entries
            ],
            next_token=page.next_token,
        )

    async def GetCapacity(
        self, req: csi_pb2.GetCapacityRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GetCapacityResponse:
        for cap in req.volume_capabilities:
            if (malformed := malformed_reason(cap)) is not None:
                raise invalid(f"volume_capabilities: {malformed}")
        try:
            caps = [parse_capability(c, "volume_capabilities") for c in req.volume_capabilities]
            access_type = _access_type(caps) if caps else "mount"
            if access_type == "mount":
                self._fs_type(dict(req.parameters), caps)
        except CsiError:
            # Capabilities or parameters no volume could be created with: no room for them.
            return csi_pb2.GetCapacityResponse(available_capacity=0)
        # A pool kind this pool lacks is refused, not answered 0: "no room" would send the
        # scheduler's users hunting for full disks, while the refusal's message names the kinds
        # there are (the external-provisioner puts it on the StorageClass).
        kind = chosen_kind(req.parameters, self.config.capacity)
        if self._elsewhere(req) or (await asyncio.to_thread(self.state.pool_problem)) != "":
            # Another node's segment (a node-local pool holds nothing for it), or a pool that
            # cannot hold any volume: the scheduler must not count on room here.
            return csi_pb2.GetCapacityResponse(available_capacity=0)
        available = (await self.state.budget.room(kind)).left
        # CreateVolume rounds a size up to whole MiB where it may: the largest size a create can
        # be asked for and succeed is the available room rounded down to that unit.
        largest = round_down(min(available, self.config.max_volume_size), SIZE_UNIT)
        return csi_pb2.GetCapacityResponse(
            available_capacity=available,
            maximum_volume_size={"value": largest},
            minimum_volume_size={"value": MIN_UNIT},
        )

    def _elsewhere(self, req: csi_pb2.GetCapacityRequest) -> bool:
        """Whether a GetCapacity asks about a topology segment this node-local pool does not serve
        (no segment, or an empty one, asks about the pool itself)."""
        segment = req.accessible_topology.segments
        return (
            self.config.node_local
            and bool(segment)
            and not names_node(segment, self.config.local_node_id, self.config.topology_key)
        )

    async def ControllerGetCapabilities(
        self, req: csi_pb2.ControllerGetCapabilitiesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerGetCapabilitiesResponse:
        return csi_pb2.ControllerGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.ControllerServiceCapability(rpc=csi_pb2.ControllerServiceCapability.RPC(type=t))
                for t in CAPABILITIES
                if not (self.config.node_local and t in PUBLISHING)
            ]
        )

    async def ControllerGetVolume(
        self, req: csi_pb2.ControllerGetVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerGetVolumeResponse:
        vol = self._volume(req.volume_id)
        return csi_pb2.ControllerGetVolumeResponse(
            volume=self._csi_volume(vol),
            status=csi_pb2.ControllerGetVolumeResponse.VolumeStatus(
                published_node_ids=sorted(vol.published), volume_condition=self._condition(vol)
            ),
        )

    async def ControllerExpandVolume(
        self, req: csi_pb2.ControllerExpandVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerExpandVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        required, limit = req.capacity_range.required_bytes, req.capacity_range.limit_bytes
        if not required and not limit:
            # The spec makes the range REQUIRED with at least one bound: an expansion without a
            # size has no answer, and the creation default would silently grow the volume.
            raise invalid("capacity_range is required and must set required_bytes or limit_bytes")
        size = choose_size(required, limit, self.config.max_volume_size)  # checks the range itself
        async with self.state.locks.hold(volume_id):
            vol = self._volume(volume_id)
            self._refuse_moving(vol, "expanded")
            if fits(vol.capacity, required, limit):
                size = vol.capacity  # already within the range: nothing to grow
            elif limit and vol.capacity > limit:
                raise out_of_range(
                    f"volume {volume_id} holds {format_size(vol.capacity)}, more than limit_bytes {limit}; "
                    "a volume cannot shrink"
                )
            access_type = vol.access_type
            if req.HasField("volume_capability"):
                access_type = parse_capability(req.volume_capability).access_type
            if size > vol.capacity:
                try:
                    async with self._reserving(size - vol.capacity, vol.kind):
                        await asyncio.to_thread(files.grow, self.state.volume_file(volume_id), size)
                        old, vol.capacity = vol.capacity, size
                        await self.state.put_volume(vol)
                except CsiError as e:
                    # The spec's code for a capacity the plugin cannot give an existing volume;
                    # a sidecar treats it as final, so a user may ask for less and be served.
                    raise out_of_range(e.message) from e
                log.info("expanded volume", volume=volume_id, old=old, new=size)
            # A filesystem must be grown on the node; a raw block volume only needs the node's loop
            # device refreshed, which matters only while it is attached somewhere.
            # A node-local volume is never published: its staging says it is attached.
            in_use = bool(vol.published) or (
                self.config.node_local and self.state.staging(volume_id) is not None
            )
            node_expansion = access_type == "mount" or in_use
            return csi_pb2.ControllerExpandVolumeResponse(
                capacity_bytes=vol.capacity, node_expansion_required=node_expansion
            )

    # --- snapshots ------------------------------------------------------------------------------
    def _csi_snapshot(self, snap: SnapshotRecord) -> csi_pb2.Snapshot:
        return csi_pb2.Snapshot(
            size_bytes=snap.size,
            snapshot_id=snap.snapshot_id,
            source_volume_id=snap.source_volume_id,
            creation_time=_timestamp(snap.created_at),
            ready_to_use=snap.ready,
            group_snapshot_id=snap.group_snapshot_id,
        )

    async def CreateSnapshot(
        self, req: csi_pb2.CreateSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.CreateSnapshotResponse:
        name = check_name(req.name)
        source_id = check_id(req.source_volume_id, "source_volume_id")
        unknown = sorted(k for k in req.parameters if not k.startswith(PROVISIONER_PREFIX))
        if unknown:
            raise invalid(f"unknown snapshot parameters {', '.join(unknown)}; this driver takes none")
        async with self.state.locks.hold(f"snapshot-name/{name}"):
            snap = self.state.snapshot_by_name(name)
            if snap is not None and snap.source_volume_id != source_id:
                raise already_exists(
                    f"a snapshot named {name!r} already exists ({snap.snapshot_id}) "
                    f"of volume {snap.source_volume_id}"
                )
            if snap is not None and snap.ready:
                return csi_pb2.CreateSnapshotResponse(snapshot=self._csi_snapshot(snap))
            async with self.state.locks.hold(source_id):
                vol = self._volume(source_id)
                if snap is None:
                    # A copy takes what its source holds, which only a --capacity pool counts, in
                    # its source's kind.
                    budgeted = self.config.capacity.budgeted
                    async with self._reserving(vol.capacity if budgeted else 0, vol.kind):
                        snap = SnapshotRecord(
                            snapshot_id=f"snap-{uuid.uuid4().hex}",
                            name=name,
                            source_volume_id=source_id,
                            size=vol.capacity,
                            seq=self.state.next_seq(),
                            access_type=vol.access_type,
                            fs_type=vol.fs_type,
                            kind=vol.kind,
                        )
                        await self.state.put_snapshot(snap)
                try:
                    await self._fill(
                        self.state.snapshot_file(snap.snapshot_id),
                        snap.size,
                        self.state.volume_file(source_id),
                    )
                    snap.ready = True
                    await self.state.put_snapshot(snap)
                except Exception:
                    await self._roll_back(snap)  # as a failed CreateVolume: the room goes back at once
                    raise
        log.info("created snapshot", snapshot=snap.snapshot_id, name=name, volume=source_id)
        return csi_pb2.CreateSnapshotResponse(snapshot=self._csi_snapshot(snap))

    async def DeleteSnapshot(
        self, req: csi_pb2.DeleteSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.DeleteSnapshotResponse:
        snapshot_id = check_id(req.snapshot_id, "snapshot_id")
        snap = self.state.snapshot(snapshot_id)
        if snap is not None and snap.group_snapshot_id:
            # Deleted with its group (DeleteVolumeGroupSnapshot), as hostpath says.
            raise invalid(f"Snapshot with ID {snapshot_id} is part of groupsnapshot {snap.group_snapshot_id}")
        await self.delete_snapshot(snapshot_id)
        return csi_pb2.DeleteSnapshotResponse()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Removes a snapshot's copy, then its record; nothing when there is none."""
        async with self.state.locks.hold(snapshot_id):
            if self.state.snapshot(snapshot_id) is not None:
                await asyncio.to_thread(files.remove, self.state.snapshot_file(snapshot_id))
                await self.state.delete_snapshot(snapshot_id)
                log.info("deleted snapshot", snapshot=snapshot_id)

    async def ListSnapshots(
        self, req: csi_pb2.ListSnapshotsRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ListSnapshotsResponse:
        snaps = [(s.seq, s) for s in self.state.list_snapshots() if s.ready]
        if req.snapshot_id:
            snaps = [(q, s) for q, s in snaps if s.snapshot_id == req.snapshot_id]
        if req.source_volume_id:
            snaps = [(q, s) for q, s in snaps if s.source_volume_id == req.source_volume_id]
        page = paginate(snaps, req.starting_token, req.max_entries)
        return csi_pb2.ListSnapshotsResponse(
            entries=[
                csi_pb2.ListSnapshotsResponse.Entry(snapshot=self._csi_snapshot(s)) for s in page.entries
            ],
            next_token=page.next_token,
        )

    async def GetSnapshot(
        self, req: csi_pb2.GetSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GetSnapshotResponse:
        snapshot_id = check_id(req.snapshot_id, "snapshot_id")
        snap = self.state.snapshot(snapshot_id)
        if snap is None or not snap.ready:
            raise not_found(f"snapshot {snapshot_id} does not exist")
        return csi_pb2.GetSnapshotResponse(snapshot=self._csi_snapshot(snap))

    async def ControllerModifyVolume(
        self, req: csi_pb2.ControllerModifyVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.ControllerModifyVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        # Checked before anything is touched: the spec forbids a partly applied INVALID_ARGUMENT.
        params = check_mutable(req.mutable_parameters)
        async with self.state.locks.hold(volume_id):
            vol = self._volume(volume_id)
            changed = {k: v for k, v in params.items() if vol.mutable_parameters.get(k) != v}
            if changed:
                self._refuse_moving(vol, "modified")
            if not changed:
                return csi_pb2.ControllerModifyVolumeResponse()
            if problem := await asyncio.to_thread(self.state.pool_problem):
                raise failed_precondition(f"volume {volume_id} cannot be modified now: {problem}")
            # The file first, the record after: a crash in between leaves a record the retry
            # brings level (applying is idempotent).
            await asyncio.to_thread(mutable.apply, self.state.volume_file(volume_id), changed)
            vol.mutable_parameters.update(changed)
            await self.state.put_volume(vol)
        log.info("modified volume", volume=volume_id, parameters=changed)
        return csi_pb2.ControllerModifyVolumeResponse()
