"""The GroupController service: volume group snapshots (CreateVolumeGroupSnapshot,
GetVolumeGroupSnapshot, DeleteVolumeGroupSnapshot).

A group snapshot is one snapshot per volume, taken at one moment: the filesystems of the volumes
that are staged anywhere are frozen (csi_driver.freeze) while the controller copies every backing
file, then thawed. The members are ordinary snapshots of this driver (restored like any other)
that carry their group's id and name; they are deleted with the group, never alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from controller_runtime.logs import get_logger
from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from .controller import PROVISIONER_PREFIX, ControllerServer, _timestamp
from .errors import already_exists, failed_precondition, invalid, not_found
from .freeze import quiesced
from .state import DriverState, SnapshotRecord
from .validation import check_id, check_name

log = get_logger("csi.group")


@contextlib.asynccontextmanager
async def held(state: DriverState, volume_ids: list[str]) -> AsyncIterator[None]:
    """The locks of several volumes, taken in one order so that two callers never deadlock."""
    async with contextlib.AsyncExitStack() as stack:
        for vid in sorted(volume_ids):
            await stack.enter_async_context(state.locks.hold(vid))
        yield


GroupRPC = csi_pb2.GroupControllerServiceCapability.RPC
IGNORED_PARAMETER = "deletionPolicy"


class GroupControllerServer(csi_pb2_grpc.GroupControllerServicer):  # type: ignore[misc]
    def __init__(self, controller: ControllerServer) -> None:
        self.controller = controller
        self.state = controller.state
        # One group snapshot at a time: each freezes filesystems, and two at once on one volume
        # would thaw it for both when the first ends.
        self._one_at_a_time = asyncio.Lock()

    async def GroupControllerGetCapabilities(
        self, req: csi_pb2.GroupControllerGetCapabilitiesRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GroupControllerGetCapabilitiesResponse:
        cap = csi_pb2.GroupControllerServiceCapability(
            rpc=GroupRPC(type=GroupRPC.CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT)
        )
        return csi_pb2.GroupControllerGetCapabilitiesResponse(capabilities=[cap])

    def _members(self, group_id: str) -> list[SnapshotRecord]:
        return [s for s in self.state.list_snapshots() if s.group_snapshot_id == group_id]

    def _group(self, members: list[SnapshotRecord]) -> csi_pb2.VolumeGroupSnapshot:
        return csi_pb2.VolumeGroupSnapshot(
            group_snapshot_id=members[0].group_snapshot_id,
            snapshots=[self.controller._csi_snapshot(s) for s in members],
            creation_time=_timestamp(min(s.created_at for s in members)),
            ready_to_use=all(s.ready for s in members),
        )

    async def CreateVolumeGroupSnapshot(
        self, req: csi_pb2.CreateVolumeGroupSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.CreateVolumeGroupSnapshotResponse:
        name = check_name(req.name)
        if not req.source_volume_ids:
            raise invalid("source_volume_ids is required")
        ids = [check_id(v, "source_volume_ids") for v in req.source_volume_ids]
        if len(set(ids)) != len(ids):
            raise invalid("source_volume_ids names a volume twice")
        # The e2e suite's VolumeGroupSnapshotClass repeats its deletionPolicy among the parameters;
        # the class's own field is what counts, so the copy is ignored like the sidecar's keys.
        unknown = sorted(
            k for k in req.parameters if k != IGNORED_PARAMETER and not k.startswith(PROVISIONER_PREFIX)
        )
        if unknown:
            raise invalid(f"unknown group snapshot parameters {', '.join(unknown)}; this driver takes none")
        async with self.state.locks.hold(f"group-name/{name}"):
            existing = [s for s in self.state.list_snapshots() if s.group_name == name]
            if existing:
                if sorted(s.source_volume_id for s in existing) != sorted(ids):
                    raise already_exists(
                        f"a group snapshot named {name!r} already exists "
                        f"({existing[0].group_snapshot_id}) of other volumes"
                    )
                if all(s.ready for s in existing):
                    return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._group(existing))
                # Interrupted half-way: what it made goes, and the group is taken again.
                for snap in existing:
                    await self.controller._roll_back(snap)
            async with self._one_at_a_time:
                members = await self._take(name, ids)
        log.info("created group snapshot", group=members[0].group_snapshot_id, name=name, volumes=len(ids))
        return csi_pb2.CreateVolumeGroupSnapshotResponse(group_snapshot=self._group(members))

    def _staged_on(self, volume_ids: list[str]) -> dict[str, list[str]]:
        """Each volume's nodes, where its filesystem may be mounted: the nodes it is published to;
        in node-local mode this node when it has staged it (nothing is ever published)."""
        out: dict[str, list[str]] = {}
        for vid in volume_ids:
            vol = self.state.volume(vid)
            assert vol is not None
            nodes = sorted(vol.published)
            if self.controller.config.node_local and self.state.staging(vid) is not None:
                nodes = [self.controller.config.local_node_id]
            out[vid] = nodes
        return out

    async def _take(self, name: str, ids: list[str]) -> list[SnapshotRecord]:
        vols = [self.state.volume(v) for v in ids]
        missing = [v for v, vol in zip(ids, vols, strict=True) if vol is None or not vol.ready]
        if missing:
            if self.controller.config.node_local:
                raise failed_precondition(
                    f"volume(s) {', '.join(missing)} are not in the pool of node "
                    f"{self.controller.config.local_node_id}: the volumes of a group snapshot must all "
                    "be on one node"
                )
            raise not_found(f"volume(s) {', '.join(missing)} do not exist")
        group_id = f"group-{uuid.uuid4().hex}"
        now = time.time()
        members = [
            SnapshotRecord(
                snapshot_id=f"snap-{uuid.uuid4().hex}",
                name=f"{name}-{vol.volume_id}",
                source_volume_id=vol.volume_id,
                size=vol.capacity,
                seq=self.state.next_seq(),
                access_type=vol.access_type,
                fs_type=vol.fs_type,
                kind=vol.kind,
                created_at=now,
                group_snapshot_id=group_id,
                group_name=name,
            )
            for vol in vols
            if vol is not None
        ]
        budgeted = self.controller.config.capacity.budgeted
        recorded: list[SnapshotRecord] = []
        try:
            for snap in members:  # records first: a crash leaves them for the next start to roll back
                async with self.controller._reserving(snap.size if budgeted else 0, snap.kind):
                    await self.state.put_snapshot(snap)
                recorded.append(snap)
            # The volumes' locks keep them from being deleted or grown while they are copied.
            async with held(self.state, ids), quiesced(self.state, group_id, self._staged_on(ids)):
                for snap in members:
                    await self.controller._fill(
                        self.state.snapshot_file(snap.snapshot_id),
                        snap.size,
                        self.state.volume_file(snap.source_volume_id),
                    )
            for snap in members:
                snap.ready = True
                await self.state.put_snapshot(snap)
        except BaseException:
            # A member that does not fit gives back the room of those recorded before it at once,
            # as a failed CreateSnapshot does, instead of holding it until the next start.
            for snap in recorded:
                await self.controller._roll_back(snap)
            raise
        return members

    async def GetVolumeGroupSnapshot(
        self, req: csi_pb2.GetVolumeGroupSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.GetVolumeGroupSnapshotResponse:
        group_id = check_id(req.group_snapshot_id, "group_snapshot_id")
        members = self._members(group_id)
        if not members:
            raise not_found(f"group snapshot {group_id} does not exist")
        if req.snapshot_ids and sorted(req.snapshot_ids) != sorted(s.snapshot_id for s in members):
            raise invalid(f"snapshot_ids are not the snapshots of group snapshot {group_id}")
        return csi_pb2.GetVolumeGroupSnapshotResponse(group_snapshot=self._group(members))

    async def DeleteVolumeGroupSnapshot(
        self, req: csi_pb2.DeleteVolumeGroupSnapshotRequest, _: grpc.aio.ServicerContext
    ) -> csi_pb2.DeleteVolumeGroupSnapshotResponse:
        group_id = check_id(req.group_snapshot_id, "group_snapshot_id")
        members = self._members(group_id)
        if (
            req.snapshot_ids
            and members
            and sorted(req.snapshot_ids) != sorted(s.snapshot_id for s in members)
        ):
            raise invalid(f"snapshot_ids are not the snapshots of group snapshot {group_id}")
        for snap in members:
            await self.controller.delete_snapshot(snap.snapshot_id)
        if members:
            log.info("deleted group snapshot", group=group_id, snapshots=len(members))
        return csi_pb2.DeleteVolumeGroupSnapshotResponse()
