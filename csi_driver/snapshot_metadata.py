"""The SnapshotMetadata service (changed block tracking, CSI's alpha service): which ranges of a
snapshot hold data, and which changed between two snapshots of one volume.

A snapshot is a sparse copy of its volume's backing file, so what it holds is what SEEK_DATA and
SEEK_HOLE say, without reading it (`GetMetadataAllocated`); between two snapshots only the ranges
either one holds are read and compared, 4 KiB block by block (`GetMetadataDelta`). Both answer
VARIABLE_LENGTH extents (runs of blocks merged), streamed `max_results` at a time (256 when 0),
from `starting_offset` on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc

from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from .backend import files
from .errors import CsiError, invalid, not_found, out_of_range
from .state import DriverState, SnapshotRecord
from .validation import check_id

BLOCK = 4096
DEFAULT_RESULTS = 256


class SnapshotMetadataServer(csi_pb2_grpc.SnapshotMetadataServicer):  # type: ignore[misc]
    def __init__(self, state: DriverState) -> None:
        self.state = state

    def _snapshot(self, snapshot_id: str, what: str) -> SnapshotRecord:
        check_id(snapshot_id, what)
        snap = self.state.snapshot(snapshot_id)
        if snap is None or not snap.ready:
            raise not_found(f"snapshot {snapshot_id} does not exist")
        return snap

    @staticmethod
    def _window(snap: SnapshotRecord, starting_offset: int, max_results: int) -> int:
        if max_results < 0:
            raise invalid(f"max_results must not be negative, not {max_results}")
        if starting_offset < 0 or starting_offset >= snap.size:
            raise out_of_range(
                f"starting_offset {starting_offset} is outside the snapshot's {snap.size} bytes"
            )
        return max_results or DEFAULT_RESULTS

    async def GetMetadataAllocated(
        self, req: csi_pb2.GetMetadataAllocatedRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[csi_pb2.GetMetadataAllocatedResponse]:
        for rsp in await _answered(context, self._allocated(req)):
            yield rsp

    async def GetMetadataDelta(
        self, req: csi_pb2.GetMetadataDeltaRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[csi_pb2.GetMetadataDeltaResponse]:
        for rsp in await _answered(context, self._delta(req)):
            yield rsp

    async def _allocated(self, req: csi_pb2.GetMetadataAllocatedRequest) -> list[Any]:
        snap = self._snapshot(req.snapshot_id, "snapshot_id")
        per_message = self._window(snap, req.starting_offset, req.max_results)
        path = self.state.snapshot_file(snap.snapshot_id)
        ranges = await asyncio.to_thread(files.data_ranges, path, req.starting_offset, snap.size)
        return _responses(csi_pb2.GetMetadataAllocatedResponse, ranges, snap.size, per_message)

    async def _delta(self, req: csi_pb2.GetMetadataDeltaRequest) -> list[Any]:
        base = self._snapshot(req.base_snapshot_id, "base_snapshot_id")
        target = self._snapshot(req.target_snapshot_id, "target_snapshot_id")
        if base.source_volume_id != target.source_volume_id:
            raise invalid(
                f"snapshots {base.snapshot_id} and {target.snapshot_id} are of different volumes "
                f"({base.source_volume_id}, {target.source_volume_id})"
            )
        per_message = self._window(target, req.starting_offset, req.max_results)
        ranges = await asyncio.to_thread(
            files.changed_ranges,
            self.state.snapshot_file(base.snapshot_id),
            self.state.snapshot_file(target.snapshot_id),
            req.starting_offset,
            target.size,
            BLOCK,
        )
        return _responses(csi_pb2.GetMetadataDeltaResponse, ranges, target.size, per_message)


async def _answered(context: grpc.aio.ServicerContext, work: Awaitable[list[Any]]) -> list[Any]:
    """The answers of a streaming call, or its CsiError as the call's status (CsiInterceptor
    translates those for unary calls only)."""
    try:
        return await work
    except CsiError as e:
        await context.abort(e.code, e.message)
        raise  # abort raises; this is for the type checker


def _responses(message: Any, ranges: list[tuple[int, int]], capacity: int, per_message: int) -> list[Any]:
    """`ranges` as VARIABLE_LENGTH extents, `per_message` to a response of type `message`."""
    blocks = [csi_pb2.BlockMetadata(byte_offset=o, size_bytes=n) for o, n in ranges]
    return [
        message(
            block_metadata_type=csi_pb2.VARIABLE_LENGTH,
            volume_capacity_bytes=capacity,
            block_metadata=blocks[i : i + per_message],
        )
        for i in range(0, len(blocks), per_message)
    ]
