"""The SnapshotMetadata service against real snapshots of a block volume written through its loop
device: the allocated ranges of a snapshot, and the blocks that changed between two snapshots of
one volume, exactly as written; and the errors the spec names. Served and tested over gRPC
directly (the external-snapshot-metadata sidecar is not deployed; docs/csi-surfaces.md)."""

from __future__ import annotations

import os

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc

from .conftest import Client, Driver
from .volumes import Attached, block_cap, code_of, create

pytestmark = pytest.mark.root

KiB, MiB = 1 << 10, 1 << 20


def write_at(device: str, writes: dict[int, int]) -> None:
    """Writes `length` bytes of 0xAB at each offset (all 4 KiB aligned), durably."""
    fd = os.open(device, os.O_RDWR)
    try:
        for offset, length in writes.items():
            os.pwrite(fd, b"\xab" * length, offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def snapshot(client: Client, name: str, volume_id: str) -> str:
    req = csi_pb2.CreateSnapshotRequest(name=name, source_volume_id=volume_id)
    return str(client.controller.CreateSnapshot(req).snapshot.snapshot_id)


def stub(client: Client) -> csi_pb2_grpc.SnapshotMetadataStub:
    return csi_pb2_grpc.SnapshotMetadataStub(client.channel)


def allocated(client: Client, snap: str, start: int = 0, max_results: int = 0) -> list[tuple[int, int]]:
    req = csi_pb2.GetMetadataAllocatedRequest(
        snapshot_id=snap, starting_offset=start, max_results=max_results
    )
    out = []
    for rsp in stub(client).GetMetadataAllocated(req):
        assert rsp.block_metadata_type == csi_pb2.VARIABLE_LENGTH and rsp.volume_capacity_bytes == 64 * MiB
        assert not max_results or len(rsp.block_metadata) <= max_results
        out += [(b.byte_offset, b.size_bytes) for b in rsp.block_metadata]
    return out


def delta(client: Client, base: str, target: str, start: int = 0) -> list[tuple[int, int]]:
    req = csi_pb2.GetMetadataDeltaRequest(
        base_snapshot_id=base, target_snapshot_id=target, starting_offset=start
    )
    return [
        (b.byte_offset, b.size_bytes)
        for rsp in stub(client).GetMetadataDelta(req)
        for b in rsp.block_metadata
    ]


def test_allocated_and_changed_blocks_are_what_was_written(driver: Driver, client: Client) -> None:
    caps = client.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest()).capabilities
    assert csi_pb2.PluginCapability.Service.SNAPSHOT_METADATA_SERVICE in {c.service.type for c in caps}
    vol = create(client, "cbt", size=64 * MiB, cap=block_cap())
    att = Attached(client, driver, vol.volume_id, block_cap())
    try:
        write_at(att.target, {0: 8 * KiB, 1 * MiB: 64 * KiB, 10 * MiB: 4 * KiB})
        first = snapshot(client, "first", vol.volume_id)
        # Overwrite one block of the first run, add a new run, leave the rest.
        write_at(att.target, {4 * KiB: 4 * KiB, 20 * MiB: 12 * KiB})
        second = snapshot(client, "second", vol.volume_id)
    finally:
        att.close()
    assert allocated(client, first) == [(0, 8 * KiB), (1 * MiB, 64 * KiB), (10 * MiB, 4 * KiB)]
    assert allocated(client, second, start=2 * MiB) == [(10 * MiB, 4 * KiB), (20 * MiB, 12 * KiB)]
    assert len(allocated(client, second, max_results=1)) == 4, "streamed one extent per message"
    # 0xAB over 0xAB at 4 KiB is no change: only the new run differs.
    assert delta(client, first, second) == [(20 * MiB, 12 * KiB)]
    assert delta(client, first, first) == []


def test_the_errors_the_spec_names(driver: Driver, client: Client) -> None:
    one, two = create(client, "one", cap=block_cap()), create(client, "two", cap=block_cap())
    a, b = snapshot(client, "a", one.volume_id), snapshot(client, "b", two.volume_id)

    def first(req: csi_pb2.GetMetadataAllocatedRequest | csi_pb2.GetMetadataDeltaRequest) -> grpc.StatusCode:
        call = (
            stub(client).GetMetadataAllocated
            if isinstance(req, csi_pb2.GetMetadataAllocatedRequest)
            else stub(client).GetMetadataDelta
        )
        return code_of(lambda: list(call(req)))

    Alloc, Delta = csi_pb2.GetMetadataAllocatedRequest, csi_pb2.GetMetadataDeltaRequest
    assert first(Alloc()) == grpc.StatusCode.INVALID_ARGUMENT
    assert first(Alloc(snapshot_id="snap-missing")) == grpc.StatusCode.NOT_FOUND
    assert first(Alloc(snapshot_id=a, starting_offset=1 << 40)) == grpc.StatusCode.OUT_OF_RANGE
    assert first(Alloc(snapshot_id=a, starting_offset=-1)) == grpc.StatusCode.OUT_OF_RANGE
    assert first(Alloc(snapshot_id=a, max_results=-1)) == grpc.StatusCode.INVALID_ARGUMENT
    assert first(Delta(base_snapshot_id=a)) == grpc.StatusCode.INVALID_ARGUMENT
    assert first(Delta(base_snapshot_id=a, target_snapshot_id=b)) == grpc.StatusCode.INVALID_ARGUMENT
    assert first(Delta(base_snapshot_id="snap-missing", target_snapshot_id=b)) == grpc.StatusCode.NOT_FOUND
