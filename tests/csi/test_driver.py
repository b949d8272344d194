"""The driver against real loop devices, filesystems and mounts (root): data survives the whole
lifecycle and a kill -9 of the driver; clones and restored snapshots hold the source's data;
expansion keeps data; hostile ids and paths are refused."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from csi_driver import DRIVER_NAME, TOPOLOGY_KEY
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from .conftest import Client, Driver, force_cleanup, loop_devices_under, start_second_node
from .volumes import (
    Attached,
    MiB,
    Mode,
    block_cap,
    code_of,
    create,
    expand,
    fs_bytes,
    mount_cap,
    read_digest,
    write_data,
)

pytestmark = pytest.mark.root


def test_data_survives_restage_and_kill9(driver: Driver, client: Client) -> None:
    vol = create(client, "survivor")
    att = Attached(client, driver, vol.volume_id, mount_cap())
    digest = write_data(att.target)
    att.unpublish()
    att.unstage()
    assert not loop_devices_under(driver.pool), "unstage must detach the loop device"
    att.stage()
    att.publish()
    assert read_digest(att.target) == digest

    driver.kill9()
    driver.start()
    # Everything acknowledged before the kill is still known: the volume, its publication, the
    # staging and the node publication.
    listed = client.controller.ListVolumes(csi_pb2.ListVolumesRequest())
    entry = next(e for e in listed.entries if e.volume.volume_id == vol.volume_id)
    assert list(entry.status.published_node_ids) == [driver.node_id]
    stats = client.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id=vol.volume_id, volume_path=att.target)
    )
    assert not stats.volume_condition.abnormal, stats.volume_condition.message
    assert stats.usage[0].used >= 4 * MiB
    assert read_digest(att.target) == digest
    # Idempotent calls after restart are no-ops, not errors.
    att.stage()
    att.publish()
    att.close()
    assert not loop_devices_under(driver.pool)
    client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
    assert not os.path.exists(driver.pool / "volumes" / f"{vol.volume_id}.img")


@pytest.mark.parametrize("delay", [0.0, 0.02, 0.05, 0.1])
def test_kill9_during_stage_then_retry(driver: Driver, client: Client, delay: float) -> None:
    """kill -9 while NodeStageVolume runs (losetup, mkfs, mount); the retry after restart finishes
    it and unstage leaves nothing attached."""
    vol = create(client, f"crashy-{delay}")
    cap = mount_cap()
    staging = str(driver.kubelet / "staging")
    os.makedirs(staging, exist_ok=True)
    req = csi_pb2.NodeStageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=staging, volume_capability=cap
    )
    errors: list[BaseException] = []

    def stage() -> None:
        try:
            client.node.NodeStageVolume(req, timeout=20)
        except grpc.RpcError as e:
            errors.append(e)

    worker = threading.Thread(target=stage)
    worker.start()
    time.sleep(delay)
    driver.kill9()
    worker.join()
    driver.start()
    client.node.NodeStageVolume(req)
    target = str(driver.kubelet / "target")
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=vol.volume_id, staging_target_path=staging, target_path=target, volume_capability=cap
        )
    )
    write_data(target)
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=vol.volume_id, target_path=target)
    )
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
    )
    assert not loop_devices_under(driver.pool)


def test_clone_and_snapshot_restore_hold_data(driver: Driver, client: Client) -> None:
    src = create(client, "source")
    att = Attached(client, driver, src.volume_id, mount_cap(), "src")
    digest = write_data(att.target)
    att.close()

    snap = client.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name="snap", source_volume_id=src.volume_id)
    ).snapshot
    assert snap.ready_to_use and snap.size_bytes == src.capacity_bytes
    restored = create(
        client,
        "restored",
        volume_content_source=csi_pb2.VolumeContentSource(
            snapshot=csi_pb2.VolumeContentSource.SnapshotSource(snapshot_id=snap.snapshot_id)
        ),
    )
    clone = create(
        client,
        "clone",
        size=256 * MiB,
        volume_content_source=csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=src.volume_id)
        ),
    )
    assert clone.capacity_bytes == 256 * MiB

    # Copies keep holes: a 128 MiB volume holding ~4 MiB of data plus ext4 metadata stays small.
    for vid in (restored.volume_id, clone.volume_id):
        st = os.stat(driver.pool / "volumes" / f"{vid}.img")
        assert st.st_blocks * 512 < 64 * MiB, f"{vid} lost its holes: {st.st_blocks * 512} bytes allocated"

    for name, vid in (("restored", restored.volume_id), ("clone", clone.volume_id)):
        copy = Attached(client, driver, vid, mount_cap(), name)
        try:
            assert read_digest(copy.target) == digest
        finally:
            copy.close()

    # Smaller than the source is refused.
    assert (
        code_of(
            lambda: create(
                client,
                "too-small",
                size=64 * MiB,
                volume_content_source=csi_pb2.VolumeContentSource(
                    volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=src.volume_id)
                ),
            )
        )
        == grpc.StatusCode.OUT_OF_RANGE
    )


def has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        eff = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    return bool(eff & (1 << 24))


@pytest.mark.parametrize(
    ("fs_type", "size", "grown"), [("ext4", 128 * MiB, 256 * MiB), ("xfs", 320 * MiB, 512 * MiB)]
)
def test_online_expansion_keeps_data(
    driver: Driver, client: Client, fs_type: str, size: int, grown: int
) -> None:
    vol = create(client, f"grow-{fs_type}", size=size, cap=mount_cap(fs_type))
    att = Attached(client, driver, vol.volume_id, mount_cap(fs_type))
    try:
        digest = write_data(att.target)
        before = fs_bytes(att.target)
        rsp = expand(client, vol.volume_id, grown)
        assert rsp.capacity_bytes == grown and rsp.node_expansion_required
        node_expand = csi_pb2.NodeExpandVolumeRequest(
            volume_id=vol.volume_id,
            volume_path=att.target,
            capacity_range=csi_pb2.CapacityRange(required_bytes=grown),
        )
        if fs_type.startswith("ext") and not has_cap_sys_resource():
            # This sandbox drops CAP_SYS_RESOURCE, without which the kernel refuses online ext4 resize;
            # the driver must say so plainly (the offline path is tested below).
            with pytest.raises(grpc.RpcError) as info:
                client.node.NodeExpandVolume(node_expand)
            assert "CAP_SYS_RESOURCE" in (info.value.details() or "")
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # the spec's "volume in use"
            return
        assert client.node.NodeExpandVolume(node_expand).capacity_bytes == grown
        assert fs_bytes(att.target) > before + (grown - size) // 2
        assert read_digest(att.target) == digest
    finally:
        att.close()


@pytest.mark.parametrize(
    ("fs_type", "size", "grown"), [("ext4", 128 * MiB, 256 * MiB), ("xfs", 320 * MiB, 512 * MiB)]
)
def test_offline_expansion_grows_at_next_stage(
    driver: Driver, client: Client, fs_type: str, size: int, grown: int
) -> None:
    vol = create(client, f"grow-off-{fs_type}", size=size, cap=mount_cap(fs_type))
    att = Attached(client, driver, vol.volume_id, mount_cap(fs_type))
    digest = write_data(att.target)
    before = fs_bytes(att.target)
    att.close()
    assert expand(client, vol.volume_id, grown).capacity_bytes == grown
    att = Attached(client, driver, vol.volume_id, mount_cap(fs_type))
    try:
        assert fs_bytes(att.target) > before + (grown - size) // 2
        assert read_digest(att.target) == digest
        # NodeExpandVolume on a filesystem that already fills its device is a no-op, even online.
        client.node.NodeExpandVolume(
            csi_pb2.NodeExpandVolumeRequest(volume_id=vol.volume_id, volume_path=att.target)
        )
    finally:
        att.close()


def test_block_volume_round_trip(driver: Driver, client: Client) -> None:
    vol = create(client, "raw", cap=block_cap())
    att = Attached(client, driver, vol.volume_id, block_cap())
    payload = hashlib.shake_256(b"block").digest(MiB)
    assert stat.S_ISBLK(os.stat(att.target).st_mode)
    fd = os.open(att.target, os.O_RDWR)
    try:
        os.pwrite(fd, payload, 8 * MiB)
        os.fsync(fd)
    finally:
        os.close(fd)
    att.unpublish()
    assert not os.path.exists(att.target), "NodeUnpublishVolume must remove the target file it created"
    att.unstage()
    att.stage()
    att.publish()
    fd = os.open(att.target, os.O_RDONLY)
    try:
        assert os.pread(fd, MiB, 8 * MiB) == payload
    finally:
        os.close(fd)
    att.close()


def test_never_reformats_existing_data(driver: Driver, client: Client) -> None:
    vol = create(client, "keep")
    att = Attached(client, driver, vol.volume_id, mount_cap("ext4"))
    att.close()
    staging = str(driver.kubelet / "staging-xfs")
    os.makedirs(staging)
    code = code_of(
        lambda: client.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=vol.volume_id, staging_target_path=staging, volume_capability=mount_cap("xfs")
            )
        )
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
    )


@pytest.mark.parametrize(
    "bad_id", ["../../etc/passwd", "..", "/etc/passwd", "a/b", "vol\x00x", ".hidden", "x" * 200]
)
def test_hostile_volume_ids_rejected(driver: Driver, client: Client, bad_id: str) -> None:
    staging = str(driver.kubelet / "staging")
    calls = [
        lambda: client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=bad_id)),
        lambda: client.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(
                volume_id=bad_id, node_id=driver.node_id, volume_capability=mount_cap()
            )
        ),
        lambda: client.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=bad_id, capacity_range=csi_pb2.CapacityRange(required_bytes=MiB)
            )
        ),
        lambda: client.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=bad_id, staging_target_path=staging, volume_capability=mount_cap()
            )
        ),
        lambda: client.controller.CreateVolume(
            csi_pb2.CreateVolumeRequest(
                name="x",
                volume_capabilities=[mount_cap()],
                volume_content_source=csi_pb2.VolumeContentSource(
                    volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=bad_id)
                ),
            )
        ),
        lambda: client.controller.CreateSnapshot(
            csi_pb2.CreateSnapshotRequest(name="s", source_volume_id=bad_id)
        ),
    ]
    for call in calls:
        assert code_of(call) == grpc.StatusCode.INVALID_ARGUMENT
    assert os.path.exists("/etc/passwd")


def test_hostile_paths_rejected(driver: Driver, client: Client, tmp_path: Path) -> None:
    vol = create(client, "paths")
    bystander = tmp_path / "bystander"
    bystander.write_text("not the driver's")
    for staging in ["relative/path", "/tmp/../etc", "/", "/tmp/a\x00b"]:
        code = code_of(
            lambda s=staging: client.node.NodeStageVolume(
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=s, volume_capability=mount_cap()
                )
            )
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT, staging
    # Unpublishing a path outside the kubelet directory is refused; one inside that the driver
    # never published is left alone.
    code = code_of(
        lambda: client.node.NodeUnpublishVolume(
            csi_pb2.NodeUnpublishVolumeRequest(volume_id=vol.volume_id, target_path=str(bystander))
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    inside = driver.kubelet / "bystander"
    inside.write_text("not the driver's")
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=vol.volume_id, target_path=str(inside))
    )
    assert bystander.read_text() == "not the driver's" and inside.read_text() == "not the driver's"


def test_single_node_volume_refused_on_second_node(driver: Driver, client: Client) -> None:
    other = start_second_node(driver)
    try:
        vol = create(client, "rwo")
        publish = csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id="node-a", volume_capability=mount_cap()
        )
        client.controller.ControllerPublishVolume(publish)
        publish.node_id = "node-b"
        assert (
            code_of(lambda: client.controller.ControllerPublishVolume(publish))
            == grpc.StatusCode.FAILED_PRECONDITION
        )
        # A multi-node-reader volume may go to both; a multi-writer filesystem may go nowhere.
        rox = create(client, "rox", cap=mount_cap(mode=Mode.MULTI_NODE_READER_ONLY))
        for node in ("node-a", "node-b"):
            client.controller.ControllerPublishVolume(
                csi_pb2.ControllerPublishVolumeRequest(
                    volume_id=rox.volume_id,
                    node_id=node,
                    volume_capability=mount_cap(mode=Mode.MULTI_NODE_READER_ONLY),
                    readonly=True,
                )
            )
        got = client.controller.ControllerGetVolume(
            csi_pb2.ControllerGetVolumeRequest(volume_id=rox.volume_id)
        )
        assert sorted(got.status.published_node_ids) == ["node-a", "node-b"]
        assert code_of(lambda: create(client, "rwx", cap=mount_cap(mode=Mode.MULTI_NODE_MULTI_WRITER))) == (
            grpc.StatusCode.INVALID_ARGUMENT
        )
        create(client, "rwx-block", cap=block_cap(mode=Mode.MULTI_NODE_MULTI_WRITER))
    finally:
        other.stop()
        force_cleanup(other.root)


def test_concurrent_creates_by_name_agree(driver: Driver, client: Client) -> None:
    results: list[str] = []
    lock = threading.Lock()

    def worker() -> None:
        vid = create(client, "same-name").volume_id
        with lock:
            results.append(vid)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 8 and len(set(results)) == 1
    assert len(client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries) == 1


def test_capacity_and_topology(csi_root: Path) -> None:
    work = csi_root / "capacity"
    work.mkdir()
    d = Driver(work, "all", "node-c", ["--capacity", "300Mi", "--max-volume-size", "200Mi"]).start()
    client = Client(d.endpoint)
    try:
        cap = client.controller.GetCapacity(csi_pb2.GetCapacityRequest())
        assert cap.available_capacity == 300 * MiB and cap.maximum_volume_size.value == 200 * MiB
        assert code_of(lambda: create(client, "huge", size=256 * MiB)) == grpc.StatusCode.OUT_OF_RANGE
        vol = create(
            client,
            "topo",
            size=200 * MiB,
            accessibility_requirements=csi_pb2.TopologyRequirement(
                preferred=[csi_pb2.Topology(segments={TOPOLOGY_KEY: "node-c"})]
            ),
        )
        assert dict(vol.accessible_topology[0].segments) == {TOPOLOGY_KEY: "node-c"}
        assert code_of(lambda: create(client, "full", size=200 * MiB)) == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = client.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        assert dict(info.accessible_topology.segments) == {TOPOLOGY_KEY: "node-c"}
    finally:
        client.close()
        d.stop()


def test_socket_registration_metrics_and_sigterm(csi_root: Path) -> None:
    work = csi_root / "process"
    work.mkdir()
    kubelet = work / "kubelet"
    stale = kubelet / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"
    stale.parent.mkdir(parents=True)
    import socket as socketlib

    with socketlib.socket(socketlib.AF_UNIX) as s:  # a socket nobody listens on any more
        s.bind(str(stale))
    with socketlib.socket() as free:  # a free loopback port for the metrics endpoint
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    d = Driver(
        work, "node", "node-r", ["--kubelet-root-dir", str(kubelet), "--http-endpoint", f"127.0.0.1:{port}"]
    )
    d.start()
    try:
        assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o600
        with grpc.insecure_channel(f"unix://{stale}") as ch:
            info = api_pb2_grpc.RegistrationStub(ch).GetInfo(api_pb2.InfoRequest(), timeout=5)
            assert (info.type, info.name, info.endpoint, list(info.supported_versions)) == (
                "CSIPlugin",
                DRIVER_NAME,
                str(d.socket),
                ["1.0.0"],
            )
            api_pb2_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                api_pb2.RegistrationStatus(plugin_registered=True), timeout=5
            )
        client = Client(d.endpoint)
        client.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
        # node mode serves no controller
        assert code_of(lambda: client.controller.ListVolumes(csi_pb2.ListVolumesRequest())) == (
            grpc.StatusCode.UNIMPLEMENTED
        )
        client.close()
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert (
            'csi_operations_seconds_count{driver_name="loop.csi.kubeloop.dev",grpc_status_code="OK",'
            'method_name="NodeGetInfo"}' in metrics
        )
        assert urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5).status == 200
    finally:
        assert d.stop() == 0
    assert not d.socket.exists() and not stale.exists()


def test_volume_is_accessible_from_every_node_sharing_the_pool(driver: Driver, client: Client) -> None:
    """Node plugins on one pool can all attach its files, so a volume may move between them; a node
    the pool never saw is left out of the volume's topology."""
    other = start_second_node(driver)
    try:
        wanted = [csi_pb2.Topology(segments={TOPOLOGY_KEY: n}) for n in ("node-b", "node-a", "node-x")]
        vol = create(
            client,
            "shared",
            accessibility_requirements=csi_pb2.TopologyRequirement(requisite=wanted, preferred=wanted[:1]),
        )
        assert [dict(t.segments) for t in vol.accessible_topology] == [
            {TOPOLOGY_KEY: "node-b"},
            {TOPOLOGY_KEY: "node-a"},
        ]
        for node in ("node-b", "node-a"):
            publish = csi_pb2.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=node, volume_capability=mount_cap()
            )
            client.controller.ControllerPublishVolume(publish)
            client.controller.ControllerUnpublishVolume(
                csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id=node)
            )
    finally:
        other.stop()
