"""The CSI Node service: attach a volume's backing file to a loop device, put a filesystem on it
only when it has none, mount it at the staging path, and bind-mount it into targets."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from controller_runtime.logs import get_logger
from controller_runtime.mounts import is_mounted, mounts_at, read_mounts
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from . import DRIVER_NAME, TOPOLOGY_KEY
from .backend import files, fs, loop, mounts
from .budget import Reservation
from .capabilities import Capability, Mode, parse_capability, require_capability
from .controller import CTX_ACCESS_TYPE, CTX_BACKING_FILE, CTX_FS_TYPE, CTX_READONLY, publish_context
from .ephemeral import inline_volume, is_ephemeral
from .errors import (
    CsiError,
    already_exists,
    exhausted,
    failed_precondition,
    invalid,
    not_found,
    out_of_range,
)
from .paths import KubeletDir, fd_path
from .state import DriverState, StagingRecord
from .validation import check_id, fits

log = get_logger("csi.node")

NodeRPC = csi_pb2.NodeServiceCapability.RPC
# Single-node modes that allow one target on the node: the spec's table makes a second publish
# FAILED_PRECONDITION. Kubernetes sends SINGLE_NODE_MULTI_WRITER for ReadWriteOnce to a driver
# with that capability (this one), so two pods of one node sharing a claim still work.
ONE_TARGET_MODES = frozenset(
    {Mode.SINGLE_NODE_SINGLE_WRITER, Mode.SINGLE_NODE_WRITER, Mode.SINGLE_NODE_READER_ONLY}
)
CAPABILITIES = (
    NodeRPC.STAGE_UNSTAGE_VOLUME,
    NodeRPC.GET_VOLUME_STATS,
    NodeRPC.EXPAND_VOLUME,
    NodeRPC.VOLUME_CONDITION,
    NodeRPC.SINGLE_NODE_MULTI_WRITER,
)


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    max_volumes_per_node: int
    kubelet_dir: str
    direct_io: bool = True
    # --node-local: nothing calls ControllerPublishVolume (attachRequired: false), so a stage
    # without a publish context takes what the context would say from this process's own record.
    node_local: bool = False
    # The largest inline ephemeral volume a pod may ask for (--max-volume-size).
    max_volume_size: int = 1 << 40
    # --drivername: inline volumes are staged under kubelet's plugins/<name>/, the plugin's own.
    driver_name: str = DRIVER_NAME
    topology_key: str = TOPOLOGY_KEY  # what NodeGetInfo reports (follows --drivername)


def _restage_mismatch(rec: StagingRecord, cap: Capability) -> str | None:
    """How a repeated NodeStageVolume differs from the staging it repeats, else None."""
    if cap.fs_type and rec.fs_type and cap.fs_type != rec.fs_type:
        return f"with filesystem {rec.fs_type}, not {cap.fs_type}"
    if list(cap.mount_flags) != rec.mount_flags:
        return f"with mount flags {rec.mount_flags}, not {list(cap.mount_flags)}"
    if rec.access_mode and cap.mode != rec.access_mode:
        return f"with access mode {Mode.Name(rec.access_mode)}, not {Mode.Name(cap.mode)}"
    return None


def _check_republish(rec: StagingRecord, target: str, read_only: bool, cap: Capability) -> None:
    """A repeated NodePublishVolume of a mounted target: OK if it asks for the same, else the
    spec's ALREADY_EXISTS."""
    if rec.targets[target] != read_only:
        raise already_exists(
            f"volume {rec.volume_id} is already published at {target} with readonly={rec.targets[target]}"
        )
    if rec.access_mode and cap.mode != rec.access_mode:
        raise already_exists(
            f"volume {rec.volume_id} is already published at {target} with access mode "
            f"{Mode.Name(rec.access_mode)}"
        )


def _read_only_device(rec: StagingRecord) -> bool:
    """Whether the staged loop device itself is read-only: a block volume staged read-only (a
    read-only ControllerPublish or a reader-only access mode). A filesystem's read-only staging
    is its "ro" mount; its device stays writable for the journal the kernel may have to replay."""
    return rec.access_type == "block" and rec.read_only


def _checked_fs_type(fs_type: str, where: str) -> str:
    """An fsType from a request's context map: empty, or one of the filesystems the driver makes."""
    if fs_type and fs_type not in fs.SUPPORTED:
        raise invalid(
            f"{where} names filesystem {fs_type[:100]!r}, which is not supported; "
            f"use one of {', '.join(fs.SUPPORTED)}"
        )
    return fs_type


class NodeServer(csi_pb2_grpc.NodeServicer):  # type: ignore[misc]
    def __init__(self, state: DriverState, config: NodeConfig) -> None:
        self.state = state
        self.config = config
        # Resolved once: every staging and target path must lie strictly under it.
        self.kubelet = KubeletDir(config.kubelet_dir)

    async def _mount_on(self, path: str, what: str, source: str, fs_type: str, options: list[str]) -> None:
        """Mounts a device on a directory from a request, reached without following symlinks."""
        with self.kubelet.walked(path, what) as w:
            fd = w.open_final(directory=True)
            await mounts.mount(source, fd_path(fd), fs_type, options, name=w.path)

    async def _bind_on(
        self, source: str, src_fd: int | None, target: str, is_dir: bool, read_only: bool
    ) -> None:
        with self.kubelet.walked(target, "target_path") as w:
            fd = w.open_final(directory=is_dir)
            await mounts.bind(
                fd_path(src_fd) if src_fd is not None else source,
                fd_path(fd),
                remount_target=w.via_parent,
                read_only=read_only,
                name=w.path,
            )

    async def _unmount(self, path: str, what: str) -> None:
        if not is_mounted(path):
            return
        with self.kubelet.walked(path, what) as w:
            mode = w.kind()
            if mode is None or stat.S_ISLNK(mode):
                raise failed_precondition(f"{w.path} is no longer the path that was mounted")
            await mounts.unmount(w.path, w.via_parent)

    # --- start-up -------------------------------------------------------------------------------
    async def reconcile(self) -> None:
        """Rebuilds what this node has attached and mounted from the kernel, not from memory: the
        loop device of each staged volume is looked up by its backing file (`losetup -J`), and
        targets that are no longer mounted (/proc/self/mountinfo) are forgotten."""
        devices = await loop.list_devices()
        table = read_mounts()
        records = self.state.list_stagings()
        claimed = {d for r in records for d in (r.device, r.ro_device) if d}

        def adopt(recorded: str, attached: list[loop.LoopDevice], read_only: bool) -> str:
            """The recorded device if still attached and still ours, else one this plugin
            attached (its owner mark: this node, this kind) that no staging claims: the record
            was never written (a crash right after the attach). Never another node plugin's
            device of the same file, which shares this kernel in the local stack. "" when there
            is none; the next stage or publish attaches one."""
            owner = self._owner(read_only)
            for d in attached:
                # "" : a device attached before devices carried their owner, known by its record.
                if d.name == recorded and d.read_only == read_only and d.owner in (owner, ""):
                    return recorded
            found = next((d.name for d in attached if d.owner == owner and d.name not in claimed), "")
            claimed.add(found)
            return found

        for rec in records:
            backing = self.state.backing_file(rec)
            attached = [d for d in devices if d.backed_by(backing)]
            device = adopt(rec.device, attached, _read_only_device(rec))
            ro_device = (
                adopt(rec.ro_device, attached, True)
                if rec.access_type == "block" and not _read_only_device(rec)
                else ""
            )
            targets = {t: ro for t, ro in rec.targets.items() if is_mounted(t, table)}
            created = [t for t in rec.created_targets if t in targets]
            if (device, ro_device, targets, created) != (
                rec.device,
                rec.ro_device,
                rec.targets,
                rec.created_targets,
            ):
                log.info(
                    "reconciled staging with the kernel",
                    volume=rec.volume_id,
                    device=device or "none",
                    was=rec.device or "none",
                    read_only_device=ro_device or "none",
                    targets=len(targets),
                )
                rec.device, rec.ro_device, rec.targets, rec.created_targets = (
                    device,
                    ro_device,
                    targets,
                    created,
                )
                await self.state.put_staging(rec)
            if rec.access_type == "mount" and not is_mounted(rec.staging_path, table):
                log.warning(
                    "staged volume is not mounted; NodeStageVolume will mount it again",
                    volume=rec.volume_id,
                    staging=rec.staging_path,
                )
        if not await asyncio.to_thread(self.state.pool_problem):
            await self._settle_inline_volumes()

    async def _settle_inline_volumes(self) -> None:
        """Squares this node's inline volumes with the pool's budget after a restart, under it:
        temporary files killed writers left in ephemeral/ go; a staging whose backing file does not
        exist, with no device, target or mount (a publish killed before it made the file, or an
        unpublish killed after it removed it) is finished, its reservation and record removed, so
        no room stays held for a volume that is not there (kubelet's next publish reserves again,
        its unpublish finds nothing to undo); a reservation of this node that no staging and no
        file stand for goes; and a backing file made before inline volumes were counted is
        counted now."""
        budget, node = self.state.budget, self.config.node_id
        async with budget.deciding():
            for name in await asyncio.to_thread(budget.sweep):
                log.info("removed a temporary file of a killed inline volume publish", file=name)
            reservations = await asyncio.to_thread(budget.reservations)
            stagings = {r.volume_id: r for r in self.state.list_stagings() if r.ephemeral}
            for rec in stagings.values():
                try:
                    size = (await asyncio.to_thread(os.lstat, self.state.backing_file(rec))).st_size
                except FileNotFoundError:
                    size = -1
                in_use = rec.device or rec.ro_device or rec.targets or is_mounted(rec.staging_path)
                if size < 0 and not in_use:
                    await asyncio.to_thread(budget.release, rec.volume_id)
                    await self.state.delete_staging(rec.volume_id)
                    log.info("finished an inline volume a killed call left", volume=rec.volume_id)
                elif size >= 0 and rec.volume_id not in reservations:
                    await asyncio.to_thread(budget.reserve, Reservation(rec.volume_id, size, "", node))
                    log.info("counted an inline volume made before they were counted", volume=rec.volume_id)
            for r in reservations.values():
                if r.node != node or r.volume_id in stagings:
                    continue
                if not await asyncio.to_thread(os.path.lexists, self.state.ephemeral_file(r.volume_id)):
                    await asyncio.to_thread(budget.release, r.volume_id)
                    log.info("released the reservation of an inline volume that is gone", volume=r.volume_id)

    # --- helpers --------------------------------------------------------------------------------
    def _publish_context(self, volume_id: str, given: Mapping[str, str]) -> dict[str, str]:
        """The publish context a stage goes by. A node-local plugin is never published
        (attachRequired: false) and holds the volume's record itself: without a context it reads
        the same facts there, under the volume's lock, so the stage is checked exactly as a
        published one (the volume exists and is complete, and what it holds decides the access
        type and filesystem). A shared pool's node plugin goes by what it was given."""
        if given or not self.config.node_local:
            return dict(given)
        vol = self.state.volume(volume_id)
        if vol is None or not vol.ready:
            raise not_found(f"volume {volume_id} does not exist in the pool of node {self.config.node_id}")
        if vol.leaving_to:
            # A move released it (csi_driver.transfer.moves): its data must not change now.
            raise failed_precondition(
                f"volume {volume_id} is being moved from node {self.config.node_id} to node "
                f"{vol.leaving_to} (kubectl kubeloop move); it is staged there once the move is done"
            )
        # Read-only is the capability's (a reader-only mode) and the publish's readonly flag.
        return publish_context(vol, readonly=False)

    def _backing_file(self, volume_id: str, publish_context: dict[str, str]) -> str:
        backing = self.state.volume_file(volume_id)
        hint = publish_context.get(CTX_BACKING_FILE)
        # The controller names the file relative to its pool; a node must resolve it to the very
        # same file in its own pool, or the two plugins were configured with different pools.
        if hint and os.path.normpath(os.path.join(self.state.pool_dir, hint)) != backing:
            raise failed_precondition(
                f"publish_context names backing file {hint!r}, which is not {backing} in this node's "
                f"--pool-dir {self.state.pool_dir}"
            )
        try:
            mode = os.lstat(backing).st_mode
        except FileNotFoundError:
            raise not_found(f"volume {volume_id} does not exist: no backing file {backing}") from None
        if not stat.S_ISREG(mode):
            # Checked again where the file is opened (files.open_regular); this is the clear answer.
            raise failed_precondition(
                f"backing file {backing} of volume {volume_id} is not a regular file (a symlink?); "
                "the driver never follows one out of the pool"
            )
        return backing

    def _owner(self, read_only: bool) -> str:
        """The mark this plugin writes into the loop devices it attaches: which node (hashed to
        fit the kernel's 64 bytes) and which kind, so reconcile adopts only its own."""
        node = hashlib.sha256(self.config.node_id.encode()).hexdigest()[:16]
        return f"kubeloop:{node}:{'ro' if read_only else 'rw'}"

    async def _attach(self, rec: StagingRecord, backing: str, read_only: bool, field: str) -> str:
        """Attaches a loop device of `backing` and records it in `field` of the staging record at
        once: a later step may fail (a foreign filesystem, a mount error), and NodeUnstage
        detaches only what the record names. If the record cannot be written the device is
        detached again, so a retry never leaves a second one behind. A plugin killed between the
        attach and the write adopts the device at start by its owner mark (reconcile)."""
        owner = self._owner(read_only)
        dev = await loop.attach(backing, direct_io=self.config.direct_io, read_only=read_only, owner=owner)
        setattr(rec, field, dev.name)
        try:
            await self.state.put_staging(rec)
        except BaseException:
            setattr(rec, field, "")
            await loop.detach(dev.name)
            raise
        return dev.name

    async def _ensure_device(self, rec: StagingRecord, backing: str) -> str:
        if await loop.is_attached(rec.device, backing):
            return rec.device
        return await self._attach(rec, backing, _read_only_device(rec), "device")

    async def _ensure_read_only_device(self, rec: StagingRecord, backing: str) -> str:
        """The read-only loop device that read-only block targets of a read-write staging get."""
        if await loop.is_attached(rec.ro_device, backing):
            return rec.ro_device
        return await self._attach(rec, backing, True, "ro_device")

    async def _ensure_filesystem(self, rec: StagingRecord, device: str, backing: str, requested: str) -> str:
        """The volume's filesystem, made if the device is blank. Under an exclusive lock on the
        backing file: node plugins sharing the pool (the local stack's nodes) staging one fresh
        ReadOnlyMany volume at once would otherwise each run mkfs on it; the second waits, then
        finds the first one's filesystem."""
        fd = await asyncio.to_thread(files.lock_exclusive, backing)
        try:
            return await self._make_filesystem(rec, device, backing, requested)
        finally:
            os.close(fd)  # releases the lock

    async def _make_filesystem(self, rec: StagingRecord, device: str, backing: str, requested: str) -> str:
        volume_id = rec.volume_id
        if rec.formatting:
            # This staging's own mkfs was killed: whatever it left is half-made, even a signature
            # blkid recognises (mkfs.xfs writes its superblock early), and no data can be on it
            # (nothing is published before the stage that made it answered). It is made again.
            fs_type = requested or fs.DEFAULT_FS
            await fs.mkfs(device, fs_type, overwrite=True)
            rec.formatting = False  # saved with the staging that follows
            return fs_type
        sig = await fs.probe(device)
        if sig.fs_type and sig.fs_type not in fs.SUPPORTED:
            # Whoever wrote the data chose this type (a block volume cloned into a filesystem
            # volume, say): the kernel's parser for it is not one this driver offers to mount.
            raise failed_precondition(
                f"volume {volume_id} holds a {sig.fs_type} filesystem, which this driver does not "
                f"mount; it mounts {', '.join(fs.SUPPORTED)}"
            )
        if sig.fs_type:
            if requested and sig.fs_type != requested:
                raise failed_precondition(
                    f"volume {volume_id} already holds a {sig.fs_type} filesystem but {requested} was "
                    "requested; kubeloop never reformats a volume that has data"
                )
            return sig.fs_type
        if not sig.blank:
            raise failed_precondition(
                f"volume {volume_id} has a {sig.pt_type} partition table and no filesystem; "
                "refusing to format it"
            )
        # blkid knows no signature, which raw data from a block volume has none of either: data in
        # the backing file is kept unless this staging's own mkfs was killed half way.
        if not rec.formatting and await asyncio.to_thread(files.holds_data, backing):
            raise failed_precondition(
                f"volume {volume_id} holds data but no filesystem (a block volume staged as a "
                "filesystem?); refusing to format it"
            )
        fs_type = requested or fs.DEFAULT_FS
        rec.formatting = True
        # Durable, like the grow mark: after a power loss mid-mkfs only this mark tells the next
        # stage that the data on the device is its own half-made filesystem.
        await self.state.put_staging(rec, durable=True)
        await fs.mkfs(device, fs_type)
        rec.formatting = False  # saved with the staging that follows
        return fs_type

    async def _grow_offline(self, rec: StagingRecord, device: str) -> None:
        await fs.check_before_grow(device, after_interrupted_grow=rec.growing)
        rec.growing = True
        await self.state.put_staging(rec, durable=True)
        await fs.resize_offline(device)
        rec.growing = False  # saved with the staging that follows

    async def _add_staging(self, rec: StagingRecord) -> None:
        """Records a new staging unless the node has --max-volumes-per-node already. The count and
        the record that raises it under one lock: stages of different volumes run at once
        (kubelet stages a pod's volumes together)."""
        async with self.state.locks.hold("node/stagings"):
            staged = self.state.staging_count()
            if staged >= self.config.max_volumes_per_node > 0:
                raise failed_precondition(
                    f"node {self.config.node_id} already has {staged} volumes staged, "
                    "its --max-volumes-per-node"
                )
            await self.state.put_staging(rec)

    def _staged(self, volume_id: str) -> StagingRecord:
        rec = self.state.staging(volume_id)
        if rec is None:
            raise not_found(f"volume {volume_id} is not staged on node {self.config.node_id}")
        return rec

    def _volume_path(self, rec: StagingRecord, path: str) -> str:
        """Checks that a volume_path from a request is where this volume is staged or published."""
        try:
            path = self.kubelet.check(path, "volume_path")
        except CsiError:
            # Relative, outside the kubelet directory...: certainly not where the volume is.
            raise not_found(f"volume {rec.volume_id} is not staged or published at {path[:200]!r}") from None
        if path != rec.staging_path and path not in rec.targets:
            raise not_found(f"volume {rec.volume_id} is not staged or published at {path!r}")
        if not self.kubelet.exists(path, "volume_path"):
            raise not_found(f"{path} does not exist")
        return path

    async def _condition(self, rec: StagingRecord, path: str) -> csi_pb2.VolumeCondition:
        backing = self.state.backing_file(rec)
        try:
            mode = (await asyncio.to_thread(os.lstat, backing)).st_mode
        except OSError:
            return csi_pb2.VolumeCondition(abnormal=True, message=f"backing file {backing} is missing")
        if not stat.S_ISREG(mode):
            return csi_pb2.VolumeCondition(
                abnormal=True, message=f"backing file {backing} is not a regular file"
            )
        if not await loop.is_attached(rec.device, backing):
            return csi_pb2.VolumeCondition(
                abnormal=True, message="loop device is not attached; restage the volume"
            )
        if not is_mounted(path):
            return csi_pb2.VolumeCondition(abnormal=True, message=f"{path} is not mounted")
        return csi_pb2.VolumeCondition(abnormal=False, message=f"attached as {rec.device}")

    # --- stage / unstage ------------------------------------------------------------------------
    async def NodeStageVolume(
        self, req: csi_pb2.NodeStageVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeStageVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        staging = await asyncio.to_thread(
            self.kubelet.validate, req.staging_target_path, "staging_target_path"
        )
        cap = require_capability(req)
        # The capability's fs_type is checked with the capability; the contexts are plain maps,
        # and what they name would otherwise pick the mkfs.<type> to run.
        from_volume = _checked_fs_type(req.volume_context.get(CTX_FS_TYPE, ""), "volume_context")
        async with self.state.locks.hold(volume_id):
            context = self._publish_context(volume_id, req.publish_context)
            read_only = context.get(CTX_READONLY) == "true" or cap.read_only
            from_publish = _checked_fs_type(context.get(CTX_FS_TYPE, ""), "publish_context")
            requested = cap.fs_type or from_volume or from_publish
            if context.get(CTX_ACCESS_TYPE) == "block" and cap.access_type == "mount":
                # The controller made it a block volume: its data is the workload's, not a filesystem.
                raise failed_precondition(
                    f"volume {volume_id} is a block volume; it cannot be staged as a filesystem"
                )
            backing = self._backing_file(volume_id, context)
            rec = self.state.staging(volume_id)
            if rec is not None and (rec.staging_path != staging or rec.access_type != cap.access_type):
                raise already_exists(
                    f"volume {volume_id} is already staged as {rec.access_type} at {rec.staging_path}"
                )
            if rec is not None and (reason := _restage_mismatch(rec, cap)) is not None:
                raise already_exists(f"volume {volume_id} is already staged at {staging} {reason}")
            if rec is None:
                # Intent first: after a crash the record tells reconcile and NodeUnstage what to undo.
                rec = StagingRecord(
                    volume_id=volume_id,
                    staging_path=staging,
                    access_type=cap.access_type,
                    mount_flags=list(cap.mount_flags),
                    read_only=read_only,
                    access_mode=cap.mode,
                )
                await self._add_staging(rec)
            device = await self._ensure_device(rec, backing)
            if cap.access_type == "mount" and not is_mounted(staging):
                fs_type = await self._ensure_filesystem(rec, device, backing, requested)
                # A volume expanded while it was not staged (offline expansion) is grown here,
                # before anyone uses it: ext offline, xfs (which only grows mounted) after mounting.
                size = await asyncio.to_thread(loop.device_size, device)
                if fs_type.startswith("ext") and (rec.growing or await fs.ext_needs_grow(device, size)):
                    await self._grow_offline(rec, device)
                await asyncio.to_thread(self.kubelet.make_dir, staging, "staging_target_path")
                options = [*cap.mount_flags, *(["ro"] if read_only else [])]
                await self._mount_on(staging, "staging_target_path", device, fs_type, options)
                if fs_type == "xfs" and not read_only:
                    await fs.grow(device, fs_type, staging)
                rec.fs_type = fs_type
                await self.state.put_staging(rec)
            elif cap.access_type == "mount" and (not rec.fs_type or rec.formatting):
                # A stage killed after its mount, before its record said so: the mount is the
                # filesystem made (a half-made one does not mount), so the record learns it now;
                # otherwise an expansion would find no filesystem, and a later stage would take
                # the finished filesystem for a half-made one.
                rec.fs_type = mounts_at(staging)[-1].fs_type
                rec.formatting = False
                await self.state.put_staging(rec)
        log.info(
            "staged volume", volume=volume_id, device=device, staging=staging, access_type=cap.access_type
        )
        return csi_pb2.NodeStageVolumeResponse()

    async def NodeUnstageVolume(
        self, req: csi_pb2.NodeUnstageVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeUnstageVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        staging = self.kubelet.check(req.staging_target_path, "staging_target_path")
        async with self.state.locks.hold(volume_id):
            rec = self.state.staging(volume_id)
            if rec is None:
                return csi_pb2.NodeUnstageVolumeResponse()
            if rec.ephemeral or rec.staging_path != staging:
                # The spec: a volume not staged at this path is already unstaged from it. An
                # inline volume is never staged by the CO: only its unpublish removes it.
                log.info(
                    "volume is not staged there", volume=volume_id, asked=staging, staged=rec.staging_path
                )
                return csi_pb2.NodeUnstageVolumeResponse()
            busy = [t for t in rec.targets if is_mounted(t)]
            if busy:
                raise failed_precondition(f"volume {volume_id} is still published at {', '.join(busy)}")
            if rec.access_type == "mount":
                await self._unmount(staging, "staging_target_path")
            backing = self.state.volume_file(volume_id)
            if rec.growing:
                # A stage killed during its offline grow: only this record knows the filesystem
                # may need repair, so the grow is finished before the record goes.
                await self._grow_offline(rec, await self._ensure_device(rec, backing))
            for device in (rec.ro_device, rec.device):
                if await loop.is_attached(device, backing):
                    await loop.detach(device)
            await self.state.delete_staging(volume_id)
        log.info("unstaged volume", volume=volume_id, staging=staging)
        return csi_pb2.NodeUnstageVolumeResponse()

    # --- publish / unpublish --------------------------------------------------------------------
    async def NodePublishVolume(
        self, req: csi_pb2.NodePublishVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodePublishVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        target = await asyncio.to_thread(self.kubelet.validate, req.target_path, "target_path")
        cap: Capability = require_capability(req)
        if is_ephemeral(req.volume_context):
            return await self._publish_ephemeral(volume_id, target, cap, req)
        if not req.staging_target_path:
            # The spec's "stage not called": this driver stages every volume.
            raise failed_precondition(
                "staging_target_path is required: this driver stages volumes (STAGE_UNSTAGE_VOLUME)"
            )
        staging = self.kubelet.check(req.staging_target_path, "staging_target_path")
        read_only = req.readonly or req.publish_context.get(CTX_READONLY) == "true" or cap.read_only
        async with self.state.locks.hold(volume_id):
            rec = self.state.staging(volume_id)
            if rec is None and not await asyncio.to_thread(
                os.path.lexists, self.state.volume_file(volume_id)
            ):
                raise not_found(f"volume {volume_id} does not exist")
            if rec is None or rec.staging_path != staging:
                raise failed_precondition(
                    f"volume {volume_id} is not staged at {staging}; call NodeStageVolume first"
                )
            if rec.access_type != cap.access_type:
                raise failed_precondition(
                    f"volume {volume_id} was staged as {rec.access_type}, not {cap.access_type}"
                )
            if target in rec.targets and is_mounted(target):
                _check_republish(rec, target, read_only, cap)
                return csi_pb2.NodePublishVolumeResponse()
            if cap.mode in ONE_TARGET_MODES:
                others = [t for t in rec.targets if t != target and is_mounted(t)]
                if others:
                    raise failed_precondition(
                        f"volume {volume_id} has access mode {Mode.Name(cap.mode)} and is already "
                        f"published at {others[0]}"
                    )
            block = cap.access_type == "block"
            if block:
                device = await self._block_device(rec, read_only)
            elif not is_mounted(staging):
                raise failed_precondition(f"{staging} is not mounted; call NodeStageVolume again")
            await self._record_target(rec, target, read_only, block)
            if block:
                await self._bind_on(device, None, target, False, read_only)
            else:
                with self.kubelet.walked(staging, "staging_target_path") as s:
                    src = s.open_final(directory=True)
                    await self._bind_on("", src, target, True, read_only)
        log.info("published volume", volume=volume_id, target=target, read_only=read_only)
        return csi_pb2.NodePublishVolumeResponse()

    async def _block_device(self, rec: StagingRecord, read_only: bool) -> str:
        """The loop device a block target gets: the staged one, or for a read-only target of a
        read-write staging a second one the kernel keeps read-only (a read-only bind mount does
        not stop writes through a device node)."""
        backing = self.state.backing_file(rec)
        if not await loop.is_attached(rec.device, backing):
            raise failed_precondition(
                f"volume {rec.volume_id} has no loop device; call NodeStageVolume again"
            )
        if _read_only_device(rec) and not read_only:
            raise failed_precondition(
                f"volume {rec.volume_id} is staged read-only on node {self.config.node_id}; "
                "it cannot be published read-write"
            )
        if read_only and not _read_only_device(rec):
            return await self._ensure_read_only_device(rec, backing)
        return rec.device

    async def _record_target(self, rec: StagingRecord, target: str, read_only: bool, block: bool) -> None:
        """Records the target, then makes it (a file for a device, else a directory).

        Recorded before anything is made or mounted, so a crash leaves a record to undo. Only what
        the driver makes itself is removed at unpublish: a file or directory that was already there
        (someone else's) stays. Whether it will make the target is known before it does, so one
        write records both; another write only if someone raced it."""
        rec.targets[target] = read_only
        ours = target in rec.created_targets
        if not ours and not await asyncio.to_thread(self.kubelet.exists, target, "target_path"):
            rec.created_targets.append(target)
        await self.state.put_staging(rec)
        make = self.kubelet.make_file if block else self.kubelet.make_dir
        made = await asyncio.to_thread(make, target, "target_path")
        if made != (target in rec.created_targets) and not ours:
            if made:
                rec.created_targets.append(target)
            else:
                rec.created_targets.remove(target)
            await self.state.put_staging(rec)

    async def NodeUnpublishVolume(
        self, req: csi_pb2.NodeUnpublishVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeUnpublishVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        target = await asyncio.to_thread(self.kubelet.validate, req.target_path, "target_path")
        async with self.state.locks.hold(volume_id):
            rec = self.state.staging(volume_id)
            # Only a target this driver published is unmounted: a request naming any other mounted
            # path must not become a way to unmount things on the host.
            if rec is not None and target in rec.targets:
                await self._unmount(target, "target_path")
                if target in rec.created_targets:
                    # Never recursive: a directory with content after unmounting is not ours.
                    try:
                        await asyncio.to_thread(self.kubelet.remove, target, "target_path")
                    except OSError as e:
                        log.warning("could not remove target", target=target, error=str(e))
                    rec.created_targets.remove(target)
                del rec.targets[target]
                await self.state.put_staging(rec)
                log.info("unpublished volume", volume=volume_id, target=target)
            elif is_mounted(target):
                raise failed_precondition(
                    f"{target} is mounted but volume {volume_id} was not published there"
                )
            # A path the driver never published is left alone: removing it could delete host files.
            if rec is not None and rec.ephemeral and not rec.targets:
                # An inline volume lives as long as its one publish (also one that never finished).
                await self._remove_ephemeral(rec)
        return csi_pb2.NodeUnpublishVolumeResponse()

    # --- inline ephemeral volumes ---------------------------------------------------------------
    def _ephemeral_staging(self, volume_id: str) -> str:
        """Where the plugin mounts an inline volume's filesystem before binding it to the pod's
        target: its own directory under the kubelet directory."""
        return os.path.join(self.kubelet.root, "plugins", self.config.driver_name, "ephemeral", volume_id)

    async def _publish_ephemeral(
        self, volume_id: str, target: str, cap: Capability, req: csi_pb2.NodePublishVolumeRequest
    ) -> csi_pb2.NodePublishVolumeResponse:
        """Makes an inline volume in this node's pool, formats and mounts it, and binds it to the
        target; a repeat finishes what an interrupted one began. A first publish that fails takes
        back everything it made, so a pod that never starts leaves nothing behind."""
        if cap.access_type != "mount":
            raise invalid("an inline ephemeral volume is a filesystem: its volume_capability must be mount")
        wanted = inline_volume(req.volume_context, cap.fs_type, self.config.max_volume_size)
        read_only = req.readonly or cap.read_only
        staging = self._ephemeral_staging(volume_id)
        backing = self.state.ephemeral_file(volume_id)
        async with self.state.locks.hold(volume_id):
            rec = self.state.staging(volume_id)
            if rec is not None and not rec.ephemeral:
                raise already_exists(f"volume {volume_id} is a persistent volume staged on this node")
            if rec is not None and target in rec.targets and is_mounted(target):
                _check_republish(rec, target, read_only, cap)
                return csi_pb2.NodePublishVolumeResponse()
            first = rec is None
            if rec is None:
                if problem := await asyncio.to_thread(self.state.pool_problem):
                    raise exhausted(f"node {self.config.node_id} cannot hold an inline volume: {problem}")
                rec = StagingRecord(
                    volume_id=volume_id,
                    staging_path=staging,
                    access_type="mount",
                    mount_flags=list(cap.mount_flags),
                    access_mode=cap.mode,
                    ephemeral=True,
                )
                await self._add_staging(rec)  # intent first: after a crash it says what to remove
            try:
                if not await asyncio.to_thread(os.path.lexists, backing):
                    # The room first (the pool's budget, shared with the controller side and every
                    # node plugin on the pool), the file while the budget is held.
                    async with self.state.budget.reserving_inline(
                        volume_id, wanted.size, wanted.kind, self.config.node_id
                    ):
                        await asyncio.to_thread(files.create_sparse, backing, wanted.size)
                device = await self._ensure_device(rec, backing)
                if not is_mounted(staging):
                    fs_type = await self._ensure_filesystem(rec, device, backing, wanted.fs_type)
                    await asyncio.to_thread(self.kubelet.make_dir, staging, "staging_target_path")
                    await self._mount_on(
                        staging, "staging_target_path", device, fs_type, list(cap.mount_flags)
                    )
                    rec.fs_type = fs_type
                    await self.state.put_staging(rec)
                await self._record_target(rec, target, read_only, False)
                with self.kubelet.walked(staging, "staging_target_path") as s:
                    src = s.open_final(directory=True)
                    await self._bind_on("", src, target, True, read_only)
            except Exception:
                if first:
                    await self._remove_ephemeral(rec, target)
                raise
        log.info(
            "published inline volume", volume=volume_id, target=target, size=wanted.size, fs_type=rec.fs_type
        )
        return csi_pb2.NodePublishVolumeResponse()

    async def _remove_ephemeral(self, rec: StagingRecord, target: str = "") -> None:
        """Undoes an inline volume, each step idempotent and the record last: a crash part-way
        leaves the record, and the next unpublish finishes."""
        for path in (target, *rec.targets):
            if path:
                await self._unmount(path, "target_path")
                if path in rec.created_targets:
                    with contextlib.suppress(OSError):
                        await asyncio.to_thread(self.kubelet.remove, path, "target_path")
        await self._unmount(rec.staging_path, "staging_target_path")
        backing = self.state.backing_file(rec)
        for device in (rec.ro_device, rec.device):
            if await loop.is_attached(device, backing):
                await loop.detach(device)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(self.kubelet.remove, rec.staging_path, "staging_target_path")
        await asyncio.to_thread(files.remove, backing)
        await asyncio.to_thread(self.state.budget.release, rec.volume_id)  # once the file is gone
        await self.state.delete_staging(rec.volume_id)
        log.info("removed inline volume", volume=rec.volume_id)

    # --- stats / expand -------------------------------------------------------------------------
    async def NodeGetVolumeStats(
        self, req: csi_pb2.NodeGetVolumeStatsRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeGetVolumeStatsResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        if not req.volume_path:
            raise invalid("volume_path is required")
        rec = self._staged(volume_id)
        path = self._volume_path(rec, req.volume_path)
        condition = await self._condition(rec, path)
        Unit = csi_pb2.VolumeUsage.Unit
        if rec.access_type == "block":
            total = await asyncio.to_thread(loop.device_size, rec.device) if rec.device else 0
            usage = [csi_pb2.VolumeUsage(total=total, unit=Unit.BYTES)]
        else:
            u = await fs.usage(path)
            usage = [
                csi_pb2.VolumeUsage(
                    total=u.total_bytes, available=u.available_bytes, used=u.used_bytes, unit=Unit.BYTES
                ),
                csi_pb2.VolumeUsage(
                    total=u.total_inodes, available=u.available_inodes, used=u.used_inodes, unit=Unit.INODES
                ),
            ]
        return csi_pb2.NodeGetVolumeStatsResponse(usage=usage, volume_condition=condition)

    async def NodeExpandVolume(
        self, req: csi_pb2.NodeExpandVolumeRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeExpandVolumeResponse:
        volume_id = check_id(req.volume_id, "volume_id")
        if not req.volume_path:
            raise invalid("volume_path is required")
        required, limit = req.capacity_range.required_bytes, req.capacity_range.limit_bytes
        if required < 0 or limit < 0 or (limit and required > limit):
            raise invalid(f"capacity_range is not a range (required_bytes={required}, limit_bytes={limit})")
        if req.HasField("volume_capability"):
            parse_capability(req.volume_capability)
        async with self.state.locks.hold(volume_id):
            rec = self._staged(volume_id)
            self._volume_path(rec, req.volume_path)
            if not rec.device:
                raise failed_precondition(
                    f"volume {volume_id} has no loop device; call NodeStageVolume again"
                )
            if rec.access_type == "mount" and (not rec.fs_type or not is_mounted(rec.staging_path)):
                raise failed_precondition(
                    f"volume {volume_id} is not mounted at its staging path; call NodeStageVolume again"
                )
            backing = self.state.volume_file(volume_id)
            for device in (rec.device, rec.ro_device):
                # Only devices still attached to this volume: a number reused by another volume
                # must not be refreshed, nor fail every retry.
                if await loop.is_attached(device, backing):
                    await loop.refresh_capacity(device)
            size = await asyncio.to_thread(loop.device_size, rec.device)
            if not fits(size, required, limit):
                # The node grows what the backing file holds; the file grows by ControllerExpandVolume.
                raise out_of_range(
                    f"volume {volume_id} is {size} bytes on this node, outside the requested range "
                    f"(required_bytes={required}, limit_bytes={limit}); expand it with the controller first"
                )
            if rec.access_type == "mount" and (
                not rec.fs_type.startswith("ext") or await fs.ext_needs_grow(rec.device, size)
            ):
                try:
                    await fs.grow(rec.device, rec.fs_type, rec.staging_path)
                except fs.ResizeNotPermitted as e:
                    # The spec's "volume in use": this filesystem can only grow while unstaged,
                    # which the next NodeStageVolume does.
                    raise failed_precondition(e.stderr.strip()) from e
        log.info("expanded volume on node", volume=volume_id, device=rec.device, size=size)
        return csi_pb2.NodeExpandVolumeResponse(capacity_bytes=size)

    # --- info -----------------------------------------------------------------------------------
    async def NodeGetCapabilities(
        self, req: csi_pb2.NodeGetCapabilitiesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeGetCapabilitiesResponse:
        return csi_pb2.NodeGetCapabilitiesResponse(
            capabilities=[
                csi_pb2.NodeServiceCapability(rpc=csi_pb2.NodeServiceCapability.RPC(type=t))
                for t in CAPABILITIES
            ]
        )

    async def NodeGetInfo(
        self, req: csi_pb2.NodeGetInfoRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.NodeGetInfoResponse:
        return csi_pb2.NodeGetInfoResponse(
            node_id=self.config.node_id,
            max_volumes_per_node=self.config.max_volumes_per_node,
            accessible_topology=csi_pb2.Topology(segments={self.config.topology_key: self.config.node_id}),
        )
