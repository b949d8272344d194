"""ControllerModifyVolume and CreateVolume's mutable_parameters against real backing files and
loop devices: `cacheMode` sets or clears the backing file's synchronous-write flag, on a volume
staged and mounted as well as on an idle one; what the driver cannot set changes nothing."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import grpc
import pytest

from csi_driver.backend.files import synchronous
from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver, loop_devices_under
from .volumes import Attached, block_cap, code_of, create, mount_cap, read_digest, write_data

MiB = 1 << 20

pytestmark = pytest.mark.root


def backing_file(driver: Driver, volume_id: str) -> str:
    return str(driver.pool / "volumes" / f"{volume_id}.img")


def modify(client: Client, volume_id: str, **params: str) -> None:
    client.controller.ControllerModifyVolume(
        csi_pb2.ControllerModifyVolumeRequest(volume_id=volume_id, mutable_parameters=params)
    )


def write(target: str, seed: bytes) -> str:
    """Writes to a published volume (a file in a filesystem, or the block device itself, durably)
    and returns the digest of what it wrote."""
    if not stat.S_ISBLK(os.stat(target).st_mode):
        return write_data(target, seed=seed)
    payload = hashlib.shake_256(seed).digest(4 * MiB)
    fd = os.open(target, os.O_RDWR)
    try:
        os.pwrite(fd, payload, MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    return hashlib.sha256(payload).hexdigest()


def read_back(target: str) -> str:
    if not stat.S_ISBLK(os.stat(target).st_mode):
        return read_digest(target)
    fd = os.open(target, os.O_RDONLY)
    try:
        return hashlib.sha256(os.pread(fd, 4 * MiB, MiB)).hexdigest()
    finally:
        os.close(fd)


def recorded(driver: Driver, volume_id: str) -> dict[str, str]:
    doc = json.loads((driver.state / "volumes" / f"{volume_id}.json").read_text())
    return dict(doc["mutable_parameters"])


def test_the_driver_says_it_can_modify(client: Client) -> None:
    caps = client.controller.ControllerGetCapabilities(csi_pb2.ControllerGetCapabilitiesRequest())
    rpcs = {c.rpc.type for c in caps.capabilities}
    assert csi_pb2.ControllerServiceCapability.RPC.MODIFY_VOLUME in rpcs


def test_a_volume_is_created_with_its_mutable_parameters(driver: Driver, client: Client) -> None:
    plain = create(client, "plain")
    through = create(client, "through", mutable_parameters={"cacheMode": "writethrough"})
    assert not synchronous(backing_file(driver, plain.volume_id))
    assert synchronous(backing_file(driver, through.volume_id))
    assert recorded(driver, through.volume_id) == {"cacheMode": "writethrough"}
    # A clone starts from its own parameters, not its source's.
    clone = create(
        client,
        "clone",
        volume_content_source=csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=through.volume_id)
        ),
    )
    assert not synchronous(backing_file(driver, clone.volume_id))


@pytest.mark.parametrize("cap", [mount_cap(), block_cap()], ids=["mount", "block"])
def test_a_staged_volume_changes_while_in_use(
    driver: Driver, client: Client, cap: csi_pb2.VolumeCapability
) -> None:
    vol = create(client, "live", cap=cap)
    path = backing_file(driver, vol.volume_id)
    att = Attached(client, driver, vol.volume_id, cap)
    try:
        assert loop_devices_under(driver.pool), "the volume must be on a loop device while modified"
        digest = write(att.target, b"before")
        modify(client, vol.volume_id, cacheMode="writethrough")
        assert synchronous(path)
        assert recorded(driver, vol.volume_id) == {"cacheMode": "writethrough"}
        # The device keeps working under the new attribute; what was written is still there.
        assert read_back(att.target) == digest
        digest = write(att.target, b"after")
        modify(client, vol.volume_id, cacheMode="writeback")
        assert not synchronous(path)
        assert read_back(att.target) == digest
    finally:
        att.close()


def test_a_modify_survives_a_kill9_and_repeats_as_a_no_op(driver: Driver, client: Client) -> None:
    vol = create(client, "durable")
    modify(client, vol.volume_id, cacheMode="writethrough")
    driver.kill9()
    driver.launch().wait_ready()
    again = Client(driver.endpoint)
    try:
        assert recorded(driver, vol.volume_id) == {"cacheMode": "writethrough"}
        modify(again, vol.volume_id, cacheMode="writethrough")
        # An empty request names no key, and the spec forbids acting on a key's absence.
        modify(again, vol.volume_id)
        assert synchronous(backing_file(driver, vol.volume_id))
    finally:
        again.close()


def test_what_the_driver_cannot_set_changes_nothing(driver: Driver, client: Client) -> None:
    vol = create(client, "kept", mutable_parameters={"cacheMode": "writethrough"})
    path = backing_file(driver, vol.volume_id)
    cases = [
        {"cacheMode": "writeback", "iops": "3000"},  # a valid key beside an unknown one
        {"cacheMode": "none"},
        {"CacheMode": "writeback"},
    ]
    for params in cases:
        with pytest.raises(grpc.RpcError) as err:
            modify(client, vol.volume_id, **params)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, params
        assert "cacheMode: writeback or writethrough" in str(err.value.details())
        assert synchronous(path), f"{params} was partly applied"
    assert recorded(driver, vol.volume_id) == {"cacheMode": "writethrough"}
    missing = "vol-" + "0" * 32
    assert code_of(lambda: modify(client, missing, cacheMode="writeback")) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: modify(client, "", cacheMode="writeback")) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: modify(client, "../x", cacheMode="writeback")) == grpc.StatusCode.INVALID_ARGUMENT
    before = sorted(p.name for p in (driver.pool / "volumes").iterdir())
    bad_create = lambda: create(client, "refused", mutable_parameters={"throughput": "fast"})  # noqa: E731
    assert code_of(bad_create) == grpc.StatusCode.INVALID_ARGUMENT
    assert sorted(p.name for p in (driver.pool / "volumes").iterdir()) == before, (
        "a refused create left a file"
    )
