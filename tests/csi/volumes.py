"""What the driver tests do to a volume through the CSI API, shared by the tests of tests/csi:
capabilities (`mount_cap`, `block_cap`), `create`, `Attached` (published, staged and node-published,
undone by `close`), `expand`, data written and read back by digest, and `code_of` a refused call."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver

MiB = 1 << 20
Mode = csi_pb2.VolumeCapability.AccessMode.Mode


def mount_cap(fs_type: str = "", mode: int = Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        mount=csi_pb2.VolumeCapability.MountVolume(fs_type=fs_type),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode),
    )


def block_cap(mode: int = Mode.SINGLE_NODE_WRITER) -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(
        block=csi_pb2.VolumeCapability.BlockVolume(),
        access_mode=csi_pb2.VolumeCapability.AccessMode(mode=mode),
    )


def create(
    client: Client,
    name: str,
    size: int = 128 * MiB,
    cap: csi_pb2.VolumeCapability | None = None,
    **kwargs: object,
) -> csi_pb2.Volume:
    req = csi_pb2.CreateVolumeRequest(
        name=name,
        capacity_range=csi_pb2.CapacityRange(required_bytes=size),
        volume_capabilities=[cap or mount_cap()],
        **kwargs,
    )
    return client.controller.CreateVolume(req).volume


class Attached:
    """Publishes, stages and node-publishes a volume; `close()` undoes it in reverse order."""

    def __init__(
        self, client: Client, driver: Driver, volume_id: str, cap: csi_pb2.VolumeCapability, name: str = "t"
    ) -> None:
        self.client, self.volume_id, self.cap = client, volume_id, cap
        self.staging = str(driver.kubelet / f"staging-{name}")
        self.target = str(driver.kubelet / f"target-{name}" / "mount")
        os.makedirs(self.staging, exist_ok=True)
        os.makedirs(os.path.dirname(self.target), exist_ok=True)
        pub = client.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(
                volume_id=volume_id, node_id=driver.node_id, volume_capability=cap
            )
        )
        self.context = dict(pub.publish_context)
        self.node_id = driver.node_id
        self.stage()
        self.publish()

    def stage(self) -> None:
        self.client.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=self.volume_id,
                staging_target_path=self.staging,
                volume_capability=self.cap,
                publish_context=self.context,
            )
        )

    def publish(self) -> None:
        self.client.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=self.volume_id,
                staging_target_path=self.staging,
                target_path=self.target,
                volume_capability=self.cap,
                publish_context=self.context,
            )
        )

    def unpublish(self) -> None:
        self.client.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=self.volume_id, target_path=self.target)
        )

    def unstage(self) -> None:
        self.client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=self.volume_id, staging_target_path=self.staging)
        )

    def close(self) -> None:
        self.unpublish()
        self.unstage()
        self.client.controller.ControllerUnpublishVolume(
            csi_pb2.ControllerUnpublishVolumeRequest(volume_id=self.volume_id, node_id=self.node_id)
        )


def write_data(target: str, size: int = 4 * MiB, seed: bytes = b"kubeloop") -> str:
    data = hashlib.shake_256(seed).digest(size)
    with open(os.path.join(target, "data.bin"), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def read_digest(target: str) -> str:
    with open(os.path.join(target, "data.bin"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def code_of(call: Callable[..., object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def fs_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize


def expand(client: Client, volume_id: str, size: int) -> csi_pb2.ControllerExpandVolumeResponse:
    return client.controller.ControllerExpandVolume(
        csi_pb2.ControllerExpandVolumeRequest(
            volume_id=volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=size)
        )
    )
