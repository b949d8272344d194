"""The driver's state directory refusing writes (a full tmpfs) in the middle of publish, stage,
expand and unpublish: the RPC fails, memory stays what the disk says, the retry after the fault
writes the record, and a restart reads back what the retries answered (issue 30)."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver, loop_devices_under, stop_and_clean
from .volumes import block_cap, code_of, create

pytestmark = pytest.mark.root

MiB = 1 << 20


@contextlib.contextmanager
def state_dir_full(state: Path) -> Iterator[None]:
    """Fills the tmpfs under the state directory until a write fails with ENOSPC; frees it after."""
    filler = state / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    try:
        yield
    finally:
        filler.unlink()


@pytest.fixture
def faulty(csi_root: Path) -> Iterator[Driver]:
    work = Path(tempfile.mkdtemp(prefix="f", dir=csi_root))
    d = Driver(work, "all", "node-a")
    d.state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(d.state)], check=True)
    d.start()
    try:
        yield d
    finally:
        stop_and_clean(d, work)  # unmounts the tmpfs too


def _restart(d: Driver) -> None:
    d.kill9()
    d.start()


def _volume(client: Client, volume_id: str) -> csi_pb2.ControllerGetVolumeResponse:
    return client.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=volume_id))


def test_a_failed_record_write_is_done_again_by_the_retry(faulty: Driver) -> None:
    d = faulty
    client = Client(d.endpoint)
    try:
        vol = create(client, "faulty", size=16 * MiB, cap=block_cap())
        publish = csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=d.node_id, volume_capability=block_cap()
        )
        with state_dir_full(d.state):
            assert code_of(lambda: client.controller.ControllerPublishVolume(publish)) != grpc.StatusCode.OK
            assert not _volume(client, vol.volume_id).status.published_node_ids, "memory ran ahead of disk"
        context = client.controller.ControllerPublishVolume(publish).publish_context
        _restart(d)
        assert list(_volume(client, vol.volume_id).status.published_node_ids) == [d.node_id]

        staging = str(d.kubelet / "staging")
        stage = csi_pb2.NodeStageVolumeRequest(
            volume_id=vol.volume_id,
            staging_target_path=staging,
            volume_capability=block_cap(),
            publish_context=context,
        )
        with state_dir_full(d.state):
            assert code_of(lambda: client.node.NodeStageVolume(stage)) != grpc.StatusCode.OK
        client.node.NodeStageVolume(stage)
        _restart(d)
        target = str(d.kubelet / "target")
        client.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=vol.volume_id,
                staging_target_path=staging,
                target_path=target,
                volume_capability=block_cap(),
                publish_context=context,
            )
        )

        grow = csi_pb2.ControllerExpandVolumeRequest(
            volume_id=vol.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MiB)
        )
        with state_dir_full(d.state):
            assert code_of(lambda: client.controller.ControllerExpandVolume(grow)) != grpc.StatusCode.OK
            assert _volume(client, vol.volume_id).volume.capacity_bytes == 16 * MiB
        assert client.controller.ControllerExpandVolume(grow).capacity_bytes == 32 * MiB
        _restart(d)
        assert _volume(client, vol.volume_id).volume.capacity_bytes == 32 * MiB

        client.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=vol.volume_id, target_path=target)
        )
        client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
        )
        assert not loop_devices_under(d.pool)
        unpublish = csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id=d.node_id)
        with state_dir_full(d.state):
            assert (
                code_of(lambda: client.controller.ControllerUnpublishVolume(unpublish)) != grpc.StatusCode.OK
            )
            assert list(_volume(client, vol.volume_id).status.published_node_ids) == [d.node_id]
        client.controller.ControllerUnpublishVolume(unpublish)
        _restart(d)
        assert not _volume(client, vol.volume_id).status.published_node_ids
        client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
        assert not os.path.exists(d.pool / "volumes" / f"{vol.volume_id}.img")
    finally:
        client.close()
