"""A copy in another access type than its source (issue 44, KEP-3141), on real loop devices: the
driver knows what each volume and snapshot holds, and refuses a restore or clone that turns a
filesystem into a raw block volume (or raw block data into a filesystem) unless the request grants
it with the parameter `snapshot.storage.kubernetes.io/allow-volume-mode-change: "true"`, which
kubeloop's external-provisioner passes from the VolumeSnapshotContent's annotation. Granted, the
copy is made and used as asked; nothing is made when refused."""

from __future__ import annotations

import os
import struct
import subprocess
from collections.abc import Callable

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver
from .volumes import Attached, MiB, block_cap, create, mount_cap, read_digest, write_data

pytestmark = pytest.mark.root

GRANT = "snapshot.storage.kubernetes.io/allow-volume-mode-change"
EXT4_MAGIC = 0xEF53  # the superblock's s_magic, 1024 + 56 bytes into an ext2/3/4 filesystem


def source_of(client: Client, kind: str, volume_id: str) -> csi_pb2.VolumeContentSource:
    """The volume itself (a clone) or a snapshot of it (a restore)."""
    if kind == "volume":
        return csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=volume_id)
        )
    snap = client.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name=f"snap-of-{volume_id}", source_volume_id=volume_id)
    ).snapshot
    return csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
    )


def refused(call: Callable[[], object]) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    return str(info.value.details())


def volume_files(driver: Driver) -> set[str]:
    return {p.name for p in (driver.pool / "volumes").glob("*.img")}


@pytest.mark.parametrize("kind", ["snapshot", "volume"])
def test_a_filesystem_becomes_a_block_volume_only_when_granted(
    driver: Driver, client: Client, kind: str
) -> None:
    src = create(client, f"fs-{kind}")
    att = Attached(client, driver, src.volume_id, mount_cap(), "src")
    digest = write_data(att.target)
    att.close()
    source = source_of(client, kind, src.volume_id)
    before = volume_files(driver)

    def copy(name: str, **parameters: str) -> csi_pb2.Volume:
        return create(client, name, cap=block_cap(), volume_content_source=source, parameters=parameters)

    message = refused(lambda: copy("raw-copy"))
    assert "holds a filesystem (ext4), not a block volume" in message, message
    assert f'{GRANT}: "true"' in message, message
    assert "false" in refused(lambda: copy("raw-copy", **{GRANT: "yes"})), "a value must be true or false"
    refused(lambda: copy("raw-copy", **{GRANT: "false"}))
    assert volume_files(driver) == before, "a refused copy left a backing file"
    listed = client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
    assert {e.volume.volume_id for e in listed} == {src.volume_id}, "a refused copy left a record"

    granted = copy("raw-copy", **{GRANT: "true"})
    raw = Attached(client, driver, granted.volume_id, block_cap(), "raw")
    try:
        # What the user of the copy sees: the filesystem's own bytes, superblock and all.
        fd = os.open(raw.target, os.O_RDONLY)
        try:
            (magic,) = struct.unpack("<H", os.pread(fd, 2, 1024 + 56))
        finally:
            os.close(fd)
        assert magic == EXT4_MAGIC
    finally:
        raw.close()
    # The source is untouched, and a copy in its own access type needs no grant.
    same = create(client, f"fs-copy-{kind}", volume_content_source=source)
    att = Attached(client, driver, same.volume_id, mount_cap(), "same")
    try:
        assert read_digest(att.target) == digest
    finally:
        att.close()


@pytest.mark.parametrize("kind", ["snapshot", "volume"])
def test_raw_block_data_becomes_a_filesystem_only_when_granted(
    driver: Driver, client: Client, kind: str
) -> None:
    """The other direction: a raw device holding an ext4 filesystem its user made is mounted only
    when granted; granted, raw data that is no filesystem is still never formatted over."""
    src = create(client, f"raw-{kind}", cap=block_cap())
    att = Attached(client, driver, src.volume_id, block_cap(), "src")
    subprocess.run(["mkfs.ext4", "-q", "-F", att.target], check=True, capture_output=True)
    att.close()
    source = source_of(client, kind, src.volume_id)

    def copy(name: str, **parameters: str) -> csi_pb2.Volume:
        return create(client, name, cap=mount_cap(), volume_content_source=source, parameters=parameters)

    message = refused(lambda: copy("fs-copy"))
    assert "holds raw block data, not a filesystem" in message and GRANT in message, message

    granted = copy("fs-copy", **{GRANT: "true"})
    mounted = Attached(client, driver, granted.volume_id, mount_cap(), "fs")
    try:
        assert os.path.ismount(mounted.target)
        digest = write_data(mounted.target)
        assert read_digest(mounted.target) == digest
    finally:
        mounted.close()

    noise = create(client, f"noise-{kind}", cap=block_cap())
    att = Attached(client, driver, noise.volume_id, block_cap(), "noise")
    fd = os.open(att.target, os.O_WRONLY)
    try:
        os.pwrite(fd, b"\xa5" * MiB, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    att.close()
    unusable = create(
        client,
        f"noise-copy-{kind}",
        cap=mount_cap(),
        volume_content_source=source_of(client, kind, noise.volume_id),
        parameters={GRANT: "true"},
    )
    with pytest.raises(grpc.RpcError) as info:
        Attached(client, driver, unusable.volume_id, mount_cap(), "noise-fs")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "holds data but no filesystem" in str(info.value.details())
    client.controller.ControllerUnpublishVolume(
        csi_pb2.ControllerUnpublishVolumeRequest(volume_id=unusable.volume_id, node_id=driver.node_id)
    )


def test_a_class_may_carry_the_grant(driver: Driver, client: Client) -> None:
    """A StorageClass parameter reaches GetCapacity and CreateVolume of every claim of the class:
    the driver takes the key (an admin's per-class grant), and a value it cannot read is refused."""
    caps = [mount_cap()]
    room = client.controller.GetCapacity(
        csi_pb2.GetCapacityRequest(volume_capabilities=caps, parameters={GRANT: "true"})
    )
    assert room.available_capacity > 0
    assert create(client, "plain-with-grant", parameters={GRANT: "true"}).volume_id
    assert GRANT in refused(lambda: create(client, "plain-bad-grant", parameters={GRANT: "True"}))
