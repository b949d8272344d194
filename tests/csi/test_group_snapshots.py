"""Volume group snapshots against real loop devices and mounts: the GroupController copies every
volume of the group while their staged filesystems are frozen (FIFREEZE by the node plugin that
staged them, asked through the pool), restores hold each volume's data, and what cannot be taken
consistently is refused and leaves nothing."""

from __future__ import annotations

import json
import os
import threading
import time

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2, csi_pb2_grpc
from tests.support.waits import consistently, eventually

from .conftest import Client, Driver, start_second_node
from .volumes import Attached, code_of, create, mount_cap, read_digest, write_data

pytestmark = pytest.mark.root


def group_stub(client: Client) -> csi_pb2_grpc.GroupControllerStub:
    return csi_pb2_grpc.GroupControllerStub(client.channel)


def take(client: Client, name: str, *volume_ids: str) -> csi_pb2.VolumeGroupSnapshot:
    req = csi_pb2.CreateVolumeGroupSnapshotRequest(name=name, source_volume_ids=list(volume_ids))
    return group_stub(client).CreateVolumeGroupSnapshot(req, timeout=60).group_snapshot


def restore(client: Client, name: str, snapshot_id: str) -> csi_pb2.Volume:
    source = csi_pb2.VolumeContentSource(
        snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snapshot_id)
    )
    return create(client, name, volume_content_source=source)


def test_a_group_snapshot_of_two_mounted_volumes_restores_both(driver: Driver, client: Client) -> None:
    a, b = create(client, "a"), create(client, "b")
    att_a = Attached(client, driver, a.volume_id, mount_cap(), "a")
    att_b = Attached(client, driver, b.volume_id, mount_cap(), "b")
    try:
        digests = {
            a.volume_id: write_data(att_a.target, seed=b"a"),
            b.volume_id: write_data(att_b.target, seed=b"b"),
        }
        group = take(client, "pair", a.volume_id, b.volume_id)
        assert group.ready_to_use and group.group_snapshot_id.startswith("group-")
        assert sorted(s.source_volume_id for s in group.snapshots) == sorted(digests)
        assert all(s.group_snapshot_id == group.group_snapshot_id and s.ready_to_use for s in group.snapshots)
        # The filesystems were frozen and thawed: the pods' volumes take writes again.
        write_data(att_a.target, seed=b"after")
        assert not list((driver.pool / "freezes").iterdir()), "a freeze request or answer is left"
        # Idempotent by name.
        again = take(client, "pair", b.volume_id, a.volume_id)
        assert again.group_snapshot_id == group.group_snapshot_id
    finally:
        att_a.close()
        att_b.close()
    for i, snap in enumerate(group.snapshots):
        vol = restore(client, f"restored-{i}", snap.snapshot_id)
        att = Attached(client, driver, vol.volume_id, mount_cap(), f"r{i}")
        try:
            assert read_digest(att.target) == digests[snap.source_volume_id]
        finally:
            att.close()
    got = group_stub(client).GetVolumeGroupSnapshot(
        csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id=group.group_snapshot_id)
    )
    assert got.group_snapshot.group_snapshot_id == group.group_snapshot_id
    member = group.snapshots[0].snapshot_id
    # A member goes with its group, not alone (hostpath's answer).
    request = csi_pb2.DeleteSnapshotRequest(snapshot_id=member)
    assert code_of(lambda: client.controller.DeleteSnapshot(request)) == grpc.StatusCode.INVALID_ARGUMENT
    group_stub(client).DeleteVolumeGroupSnapshot(
        csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=group.group_snapshot_id)
    )
    assert not list((driver.pool / "snapshots").iterdir())
    group_stub(client).DeleteVolumeGroupSnapshot(
        csi_pb2.DeleteVolumeGroupSnapshotRequest(group_snapshot_id=group.group_snapshot_id)
    )


def _blocked_write(target: str) -> tuple[threading.Thread, list[float]]:
    done: list[float] = []

    def run() -> None:
        with open(os.path.join(target, "during.txt"), "w") as f:
            f.write("x")
            f.flush()
            os.fsync(f.fileno())
        done.append(time.monotonic())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def test_a_freeze_request_holds_writes_until_it_goes_and_a_killed_plugin_thaws(
    driver: Driver, client: Client
) -> None:
    vol = create(client, "frozen")
    att = Attached(client, driver, vol.volume_id, mount_cap())
    requests = driver.pool / "freezes"
    try:
        request = requests / "manual.json"
        doc = {"volumes": [vol.volume_id], "nodes": [driver.node_id], "deadline": time.time() + 30}
        request.write_text(json.dumps(doc))
        ack = requests / f"manual.{driver.node_id}.acked"
        eventually("the node plugin's ack of the freeze", ack.exists, timeout=10, interval=0.05)
        thread, done = _blocked_write(att.target)
        consistently("no write through a frozen filesystem", lambda: not done, duration=0.5, interval=0.05)
        request.unlink()
        thread.join(10)
        assert done, "the write never finished after the thaw"

        # Frozen again, then the plugin is killed: it thaws what it held when it starts again.
        request.write_text(json.dumps({**doc, "deadline": time.time() + 300}))
        eventually("the node plugin's ack of the second freeze", ack.exists, timeout=10, interval=0.05)
        thread, done = _blocked_write(att.target)
        driver.kill9()
        request.unlink()
        ack.unlink()
        driver.start()
        thread.join(15)
        assert done, "the filesystem stayed frozen after the plugin restarted"
    finally:
        att.close()


def test_what_cannot_be_taken_is_refused_and_leaves_nothing(driver: Driver, client: Client) -> None:
    a, b = create(client, "one"), create(client, "two")
    stub = group_stub(client)
    bad = [
        (
            csi_pb2.CreateVolumeGroupSnapshotRequest(source_volume_ids=[a.volume_id]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (csi_pb2.CreateVolumeGroupSnapshotRequest(name="g"), grpc.StatusCode.INVALID_ARGUMENT),
        (
            csi_pb2.CreateVolumeGroupSnapshotRequest(name="g", source_volume_ids=[a.volume_id, a.volume_id]),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            csi_pb2.CreateVolumeGroupSnapshotRequest(
                name="g", source_volume_ids=[a.volume_id, "vol-" + "0" * 32]
            ),
            grpc.StatusCode.NOT_FOUND,
        ),
        (
            csi_pb2.CreateVolumeGroupSnapshotRequest(
                name="g", source_volume_ids=[a.volume_id], parameters={"consistency": "none"}
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
    ]
    for req, code in bad:
        assert code_of(lambda req=req: stub.CreateVolumeGroupSnapshot(req)) == code, req
    take(client, "taken", a.volume_id)
    other = csi_pb2.CreateVolumeGroupSnapshotRequest(name="taken", source_volume_ids=[b.volume_id])
    assert code_of(lambda: stub.CreateVolumeGroupSnapshot(other)) == grpc.StatusCode.ALREADY_EXISTS
    missing = csi_pb2.GetVolumeGroupSnapshotRequest(group_snapshot_id="group-missing")
    assert code_of(lambda: stub.GetVolumeGroupSnapshot(missing)) == grpc.StatusCode.NOT_FOUND
    before = sorted(p.name for p in (driver.pool / "snapshots").iterdir())
    # Published to a node whose plugin has stopped: it cannot freeze, so nothing is copied.
    start_second_node(driver).stop()
    client.controller.ControllerPublishVolume(
        csi_pb2.ControllerPublishVolumeRequest(
            volume_id=b.volume_id, node_id="node-b", volume_capability=mount_cap()
        )
    )
    with pytest.raises(grpc.RpcError) as err:
        take(client, "stuck", a.volume_id, b.volume_id)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "node-b did not freeze" in str(err.value.details())
    assert sorted(p.name for p in (driver.pool / "snapshots").iterdir()) == before
    assert not list((driver.pool / "freezes").iterdir())
