"""Inline ephemeral volumes against real loop devices and mounts: NodePublishVolume with
`csi.storage.k8s.io/ephemeral: "true"` makes the volume in the pool's ephemeral/ directory,
NodeUnpublishVolume removes it; a kill -9 at any point of either leaves nothing once kubelet's
unpublish has come; what cannot be made is refused before anything is made."""

from __future__ import annotations

import os

import grpc
import pytest

from csi_driver.backend.fs import probe
from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver, loop_devices_under
from .inline import (
    POD_INFO,
    handle,
    nothing_left,
    publish,
    publish_killed,
    publish_with,
    target_of,
    unpublish,
)
from .volumes import MiB, block_cap, code_of, read_digest, write_data

pytestmark = pytest.mark.root


def test_an_inline_volume_lives_from_its_publish_to_its_unpublish(driver: Driver, client: Client) -> None:
    target = publish(client, driver, "scratch", size="48Mi")
    backing = driver.pool / "ephemeral" / f"{handle('scratch')}.img"
    assert backing.stat().st_size == 48 * MiB
    digest = write_data(target)
    # kubelet repeats a publish it is unsure of: the same volume, its data kept.
    publish(client, driver, "scratch", size="48Mi")
    assert read_digest(target) == digest
    assert os.statvfs(target).f_blocks * os.statvfs(target).f_frsize > 36 * MiB
    # The controller never heard of it: no record of a persistent volume.
    assert not list((driver.state / "volumes").glob("*.json"))
    unpublish(client, driver, "scratch")
    unpublish(client, driver, "scratch")  # idempotent
    nothing_left(driver)


def test_size_and_filesystem_come_from_the_attributes(driver: Driver, client: Client) -> None:
    target = publish(client, driver, "xfs", size="320Mi", fsType="xfs")
    dev = loop_devices_under(driver.pool)[0]
    assert probe_type(dev) == "xfs"
    unpublish(client, driver, "xfs")
    publish(client, driver, "plain")  # no size: hostpath's 100Mi, ext4
    assert (driver.pool / "ephemeral" / f"{handle('plain')}.img").stat().st_size == 100 * MiB
    assert probe_type(loop_devices_under(driver.pool)[0]) == "ext4"
    unpublish(client, driver, "plain")
    del target
    nothing_left(driver)


def probe_type(device: str) -> str:
    import asyncio

    return asyncio.run(probe(device)).fs_type


@pytest.mark.parametrize(
    ("attributes", "code", "words"),
    [
        ({"size": "1Pi"}, grpc.StatusCode.OUT_OF_RANGE, "larger than the maximum volume size"),
        ({"size": "lots"}, grpc.StatusCode.INVALID_ARGUMENT, "is not a quantity"),
        ({"size": "0"}, grpc.StatusCode.INVALID_ARGUMENT, "more than zero"),
        ({"iops": "3000"}, grpc.StatusCode.INVALID_ARGUMENT, "unknown volumeAttributes iops"),
        ({"fsType": "btrfs"}, grpc.StatusCode.INVALID_ARGUMENT, "not supported"),
        ({"fsType": "xfs", "size": "64Mi"}, grpc.StatusCode.INVALID_ARGUMENT, "at least 300Mi"),
        ({"fsType": "xfs", "capFsType": "ext4"}, grpc.StatusCode.INVALID_ARGUMENT, "differ"),
    ],
)
def test_what_cannot_be_made_is_refused_and_nothing_is_left(
    driver: Driver, client: Client, attributes: dict[str, str], code: grpc.StatusCode, words: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        publish_with(client, driver, "bad", attributes)
    assert err.value.code() == code
    assert words in str(err.value.details())
    nothing_left(driver)


def test_a_size_the_pool_cannot_hold_is_resource_exhausted(driver: Driver, client: Client) -> None:
    st = os.statvfs(driver.pool)
    too_big = (st.f_bavail * st.f_frsize) // MiB + 1024
    with pytest.raises(grpc.RpcError) as err:
        publish(client, driver, "huge", size=f"{too_big}Mi")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "free in its pool" in str(err.value.details())
    nothing_left(driver)


def test_block_and_persistent_mixups_are_refused(driver: Driver, client: Client) -> None:
    req = csi_pb2.NodePublishVolumeRequest(
        volume_id=handle("raw"),
        target_path=target_of(driver, "raw"),
        volume_capability=block_cap(),
        volume_context=POD_INFO,
    )
    assert code_of(lambda: client.node.NodePublishVolume(req)) == grpc.StatusCode.INVALID_ARGUMENT
    # A CO unstaging an inline volume (it never staged one) does not take it from the pod.
    target = publish(client, driver, "kept")
    digest = write_data(target)
    staging = str(driver.kubelet / "plugins" / "loop.csi.kubeloop.dev" / "ephemeral" / handle("kept"))
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=handle("kept"), staging_target_path=staging)
    )
    assert read_digest(target) == digest
    unpublish(client, driver, "kept")
    nothing_left(driver)


@pytest.mark.parametrize("delay", [0.0, 0.03, 0.08, 0.15, 0.3])
def test_kill9_during_publish_leaves_nothing_after_the_unpublish(
    driver: Driver, client: Client, delay: float
) -> None:
    """kill -9 while the publish makes the file, attaches, formats and mounts; after the restart
    the pod is gone, and kubelet's unpublish (it always unpublishes a volume whose setup it is
    unsure of) removes whatever the killed publish made."""
    publish_killed(driver, "crashy", {"size": "64Mi"}, delay)
    again = Client(driver.endpoint)
    try:
        unpublish(again, driver, "crashy")
    finally:
        again.close()
    nothing_left(driver)


def test_kill9_after_publish_keeps_the_data_for_the_pod_then_unpublish_removes_it(
    driver: Driver, client: Client
) -> None:
    target = publish(client, driver, "survivor", size="64Mi")
    digest = write_data(target)
    driver.kill9()
    driver.start()
    again = Client(driver.endpoint)
    try:
        publish(again, driver, "survivor", size="64Mi")  # kubelet's next pass
        assert read_digest(target) == digest
        unpublish(again, driver, "survivor")
    finally:
        again.close()
    nothing_left(driver)
