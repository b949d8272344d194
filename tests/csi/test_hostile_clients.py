"""The driver against a hostile or unlucky client (issue 29): each test here failed on the driver
before its fix. Read-only block publishes, concurrent creates against --capacity, an fsType smuggled
in through a context map, an expansion without a size, names with control characters, a backing
file swapped for a symlink, and a CreateVolume killed half way."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import stat
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from csi_driver.backend import files
from csi_driver.node import NodeConfig, NodeServer
from csi_driver.state import DriverState, StagingRecord
from kubeloop_grpc.csi import csi_pb2

from .conftest import Client, Driver, loop_devices_under, start_second_node
from .processes import kill_during_clone, records
from .volumes import Attached, Mode, block_cap, code_of, create, mount_cap

pytestmark = pytest.mark.root

MiB = 1 << 20
GiB = 1 << 30


def _can_write(path: str) -> int:
    """0 when `path` (a device node) opens for writing and takes a write, else the errno."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except OSError as e:
        return e.errno or -1
    try:
        os.pwrite(fd, b"written through a read-only publish", 0)
        os.fsync(fd)
    except OSError as e:
        return e.errno or -1
    finally:
        os.close(fd)
    return 0


def _head(path: Path, size: int = 64) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def _publish(client: Client, att: Attached, target: str, *, readonly: bool) -> None:
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=att.volume_id,
            staging_target_path=att.staging,
            target_path=target,
            volume_capability=att.cap,
            publish_context=att.context,
            readonly=readonly,
        )
    )


def _unpublish(client: Client, volume_id: str, target: str) -> None:
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
    )


# --- 1. a read-only block publish ----------------------------------------------------------------
def test_read_only_block_publish_cannot_write_through_the_device(driver: Driver, client: Client) -> None:
    """NodePublishVolume readonly=true on a block volume: the device node in the target refuses
    writes (a read-only bind mount of a device node does not), while a read-write target of the
    same staging still writes; a kill -9 in between leaks no loop device."""
    vol = create(client, "ro-block", size=16 * MiB, cap=block_cap())
    backing = driver.pool / "volumes" / f"{vol.volume_id}.img"
    # Two targets on one node: SINGLE_NODE_MULTI_WRITER, as kubelet asks for ReadWriteOnce.
    att = Attached(client, driver, vol.volume_id, block_cap(Mode.SINGLE_NODE_MULTI_WRITER), name="rw")
    assert _can_write(att.target) == 0, "the read-write target must take writes"
    before = _head(backing)

    ro_target = str(driver.kubelet / "target-ro" / "dev")
    os.makedirs(os.path.dirname(ro_target), exist_ok=True)
    _publish(client, att, ro_target, readonly=True)
    assert _can_write(ro_target) in (errno.EROFS, errno.EPERM, errno.EACCES)
    assert _head(backing) == before, "a read-only publish changed the backing file"
    with open(ro_target, "rb") as f:
        assert f.read(len(before)) == before, "the read-only target must still read the volume"

    # The second device is remembered: after a kill -9 and a restart, unstage detaches both.
    driver.kill9()
    driver.start()
    _unpublish(client, vol.volume_id, ro_target)
    att.close()
    assert not loop_devices_under(driver.pool), "a read-only device was left attached"


def test_block_volume_published_read_only_by_the_controller_is_read_only_on_the_node(
    driver: Driver, client: Client
) -> None:
    """ControllerPublishVolume readonly=true: the staged loop device itself is read-only, and a
    read-write NodePublishVolume of it is refused (FAILED_PRECONDITION), not silently writable."""
    vol = create(client, "ro-controller", size=16 * MiB, cap=block_cap())
    pub = client.controller.ControllerPublishVolume(
        csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id, node_id=driver.node_id, volume_capability=block_cap(), readonly=True
        )
    )
    staging = str(driver.kubelet / "staging-roc")
    target = str(driver.kubelet / "target-roc" / "dev")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    client.node.NodeStageVolume(
        csi_pb2.NodeStageVolumeRequest(
            volume_id=vol.volume_id,
            staging_target_path=staging,
            volume_capability=block_cap(),
            publish_context=pub.publish_context,
        )
    )
    request = csi_pb2.NodePublishVolumeRequest(
        volume_id=vol.volume_id,
        staging_target_path=staging,
        target_path=target,
        volume_capability=block_cap(),
        publish_context={k: v for k, v in pub.publish_context.items() if "readonly" not in k},
    )
    assert code_of(lambda: client.node.NodePublishVolume(request)) == grpc.StatusCode.FAILED_PRECONDITION
    request.readonly = True
    client.node.NodePublishVolume(request)
    assert _can_write(target) in (errno.EROFS, errno.EPERM, errno.EACCES)
    _unpublish(client, vol.volume_id, target)
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
    )
    assert not loop_devices_under(driver.pool)


# --- 2. concurrent creates against --capacity ------------------------------------------------------
def test_concurrent_creates_never_overcommit_the_capacity(csi_root: Path) -> None:
    """Ten 256 MiB creates with distinct names at once against a 1 GiB --capacity: exactly four
    succeed, the others get RESOURCE_EXHAUSTED, and GetCapacity agrees with what was promised."""
    work = csi_root / "overcommit"
    work.mkdir()
    d = Driver(work, "controller", "node-a", ["--capacity", "1Gi"]).start()
    client = Client(d.endpoint)
    try:

        def attempt(i: int) -> grpc.StatusCode:
            try:
                create(client, f"race-{i}", size=256 * MiB)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(10) as pool:
            codes = list(pool.map(attempt, range(10)))
        assert codes.count(grpc.StatusCode.OK) == 4, codes
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6, codes
        listed = client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries
        assert sum(e.volume.capacity_bytes for e in listed) == GiB
        assert client.controller.GetCapacity(csi_pb2.GetCapacityRequest()).available_capacity == 0
    finally:
        client.close()
        d.stop()


# --- 3. fsType from a context map -------------------------------------------------------------------
def test_stage_runs_no_tool_for_an_fs_type_from_a_context_map(csi_root: Path) -> None:
    """NodeStageVolume with no fs_type in the capability and an unsupported fsType in the volume
    or publish context: INVALID_ARGUMENT before any tool runs (a planted mkfs.<type> on PATH stays
    unrun, no loop device is attached)."""
    work = csi_root / "fstype"
    work.mkdir()
    tools = work / "bin"
    tools.mkdir()
    marker = work / "planted-mkfs-ran"
    planted = tools / "mkfs.planted"
    planted.write_text(f"#!/bin/sh\ntouch {marker}\n")
    planted.chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"}
    d = Driver(work, "all", "node-a", env=env).start()
    client = Client(d.endpoint)
    try:
        vol = create(client, "fstype", size=16 * MiB)
        staging = str(d.kubelet / "staging")
        for fs_type in ("planted", "minix", "../../bin/sh"):
            for field in ("volume_context", "publish_context"):
                req = csi_pb2.NodeStageVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=staging, volume_capability=mount_cap()
                )
                getattr(req, field)["fsType"] = fs_type
                with pytest.raises(grpc.RpcError) as info:
                    client.node.NodeStageVolume(req)
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fs_type, field)
                assert field in (info.value.details() or "")
        assert not marker.exists(), "a planted mkfs ran"
        assert not loop_devices_under(d.pool)
    finally:
        client.close()
        d.stop()


def test_stage_refuses_to_mount_a_filesystem_the_driver_does_not_make(driver: Driver, client: Client) -> None:
    """A filesystem volume whose backing file holds a minix filesystem (written by whoever can
    write the pool): staging it is FAILED_PRECONDITION, naming the type; the kernel never parses it.
    (A block volume's data can no longer become a filesystem volume through a clone: see
    test_spec_errors.py, incompatible sources.)"""
    vol = create(client, "minix", size=16 * MiB)
    subprocess.run(
        ["mkfs.minix", str(driver.pool / "volumes" / f"{vol.volume_id}.img")], check=True, capture_output=True
    )
    staging = str(driver.kubelet / "staging-minix")
    with pytest.raises(grpc.RpcError) as info:
        client.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=vol.volume_id, staging_target_path=staging, volume_capability=mount_cap()
            )
        )
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "minix" in (info.value.details() or "")
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
    )
    assert not loop_devices_under(driver.pool)


# --- 4. an expansion without a size ----------------------------------------------------------------
def test_expand_without_a_size_is_refused_and_changes_nothing(driver: Driver, client: Client) -> None:
    """ControllerExpandVolume with a capacity range that sets neither bound: INVALID_ARGUMENT, and
    the 16 MiB volume stays 16 MiB (it used to grow to the 1 GiB creation default). A range that
    the volume already fits is a no-op; one it cannot shrink into is OUT_OF_RANGE."""
    vol = create(client, "no-size", size=16 * MiB)

    def expand(required: int, limit: int) -> csi_pb2.ControllerExpandVolumeResponse:
        return client.controller.ControllerExpandVolume(
            csi_pb2.ControllerExpandVolumeRequest(
                volume_id=vol.volume_id,
                capacity_range=csi_pb2.CapacityRange(required_bytes=required, limit_bytes=limit),
            )
        )

    assert code_of(lambda: expand(0, 0)) == grpc.StatusCode.INVALID_ARGUMENT
    no_range = csi_pb2.ControllerExpandVolumeRequest(volume_id=vol.volume_id)
    assert (
        code_of(lambda: client.controller.ControllerExpandVolume(no_range))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert expand(0, 32 * MiB).capacity_bytes == 16 * MiB
    assert expand(8 * MiB, 0).capacity_bytes == 16 * MiB
    assert code_of(lambda: expand(0, 8 * MiB)) == grpc.StatusCode.OUT_OF_RANGE
    got = client.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert got.volume.capacity_bytes == 16 * MiB
    assert os.path.getsize(driver.pool / "volumes" / f"{vol.volume_id}.img") == 16 * MiB


# --- 5. names with control characters --------------------------------------------------------------
BANNED = ["\x01", "\x08", "\x0b", "\x0c", "\x0e", "\x1b[31m", "\x1f", "\x7f", "\x85", "\x9b", "\x9f"]


@pytest.mark.parametrize("bad", BANNED, ids=[f"U+{ord(c[0]):04X}" for c in BANNED])
def test_names_with_banned_control_characters_are_refused(driver: Driver, client: Client, bad: str) -> None:
    """The spec bans U+0000-U+0008, U+000B, U+000C, U+000E-U+001F and U+007F-U+009F in names:
    CreateVolume and CreateSnapshot answer INVALID_ARGUMENT, and no raw control byte reaches the
    driver's log."""
    name = f"pvc-{bad}-x"
    assert code_of(lambda: create(client, name, size=16 * MiB)) == grpc.StatusCode.INVALID_ARGUMENT
    source = create(client, f"src-{ord(bad[0])}", size=16 * MiB)
    snapshot = csi_pb2.CreateSnapshotRequest(name=name, source_volume_id=source.volume_id)
    assert code_of(lambda: client.controller.CreateSnapshot(snapshot)) == grpc.StatusCode.INVALID_ARGUMENT
    assert not client.controller.ListSnapshots(csi_pb2.ListSnapshotsRequest()).entries
    logged = driver.log.read_bytes()
    assert bad.encode() not in logged and b"\x1b" not in logged


def test_names_of_up_to_128_bytes_with_tabs_and_unicode_are_accepted(driver: Driver, client: Client) -> None:
    """What the spec allows stays allowed: TAB, non-ASCII text, exactly 128 bytes; 129 bytes is not."""
    for name in ("tab\tname", "ünïcødé-名前", "x" * 126 + "é"):
        assert len(name.encode()) <= 128
        create(client, name, size=16 * MiB)
    assert code_of(lambda: create(client, "é" * 64 + "x", size=16 * MiB)) == grpc.StatusCode.INVALID_ARGUMENT


# --- 6. a symlink in the pool ----------------------------------------------------------------------
def test_a_backing_file_swapped_for_a_symlink_is_never_followed(driver: Driver, client: Client) -> None:
    """Whoever can write the pool replaces volumes/<id>.img with a symlink to a file outside it:
    staging, expanding and cloning it all refuse, the outside file is neither attached, grown nor
    copied, and the volume's condition turns abnormal."""
    vol = create(client, "swapped", size=16 * MiB)
    outside = driver.root / "outside.img"
    outside.write_bytes(b"secret" * 1000)
    backing = driver.pool / "volumes" / f"{vol.volume_id}.img"
    backing.unlink()
    backing.symlink_to(outside)

    staging = str(driver.kubelet / "staging-swapped")
    stage = csi_pb2.NodeStageVolumeRequest(
        volume_id=vol.volume_id, staging_target_path=staging, volume_capability=mount_cap()
    )
    assert code_of(lambda: client.node.NodeStageVolume(stage)) == grpc.StatusCode.FAILED_PRECONDITION
    assert not loop_devices_under(driver.root)
    grow = csi_pb2.ControllerExpandVolumeRequest(
        volume_id=vol.volume_id, capacity_range=csi_pb2.CapacityRange(required_bytes=32 * MiB)
    )
    assert code_of(lambda: client.controller.ControllerExpandVolume(grow)) != grpc.StatusCode.OK
    assert outside.stat().st_size == 6000, "the file outside the pool was grown"
    clone = csi_pb2.CreateVolumeRequest(
        name="swapped-clone",
        capacity_range=csi_pb2.CapacityRange(required_bytes=16 * MiB),
        volume_capabilities=[mount_cap()],
        volume_content_source=csi_pb2.VolumeContentSource(
            volume=csi_pb2.VolumeContentSource.VolumeSource(volume_id=vol.volume_id)
        ),
    )
    assert code_of(lambda: client.controller.CreateVolume(clone)) != grpc.StatusCode.OK
    copies = [p for p in (driver.pool / "volumes").iterdir() if p.name != backing.name]
    assert all(b"secret" not in p.read_bytes()[:6000] for p in copies if p.is_file())
    got = client.controller.ControllerGetVolume(csi_pb2.ControllerGetVolumeRequest(volume_id=vol.volume_id))
    assert got.status.volume_condition.abnormal
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
    )
    backing.unlink()


# --- 7. a CreateVolume killed half way -------------------------------------------------------------
def _pool_files(pool: Path, kind: str) -> set[str]:
    return {p.name.removesuffix(".img") for p in (pool / kind).glob("*.img")}


def _assert_pool_matches_the_listing(d: Driver, client: Client) -> None:
    listed = {e.volume.volume_id for e in client.controller.ListVolumes(csi_pb2.ListVolumesRequest()).entries}
    assert _pool_files(d.pool, "volumes") == listed, "a backing file that ListVolumes does not show"
    assert set(records(d.state, "volumes")) == listed, "a volume record that ListVolumes does not show"
    assert not [p for p in (d.pool / "volumes").iterdir() if not p.name.endswith(".img")]


def test_a_clone_killed_mid_copy_is_rolled_back_at_start(driver: Driver, client: Client) -> None:
    """kill -9 while a clone copies (its record written, not ready): the restarted driver rolls it
    back, file and record, so ListVolumes and the pool agree; the CO's retry by name makes it."""
    source, request = kill_during_clone(driver, client, "big-source", "killed-clone")
    driver.start()
    _assert_pool_matches_the_listing(driver, client)
    assert set(records(driver.state, "volumes")) == {source.volume_id}
    made = client.controller.CreateVolume(request).volume
    _assert_pool_matches_the_listing(driver, client)
    assert made.volume_id in records(driver.state, "volumes")


def test_a_create_killed_after_its_file_appeared_is_rolled_back_at_start(
    driver: Driver, client: Client
) -> None:
    """The state a kill -9 leaves right after the backing file appeared and before the record says
    ready (a complete file, a record not ready): after a restart neither is left, and both volume
    and snapshot records are treated so."""
    vol = create(client, "done", size=16 * MiB)
    snap = client.controller.CreateSnapshot(
        csi_pb2.CreateSnapshotRequest(name="done-snap", source_volume_id=vol.volume_id)
    ).snapshot
    driver.kill9()
    for kind, ident in (("volumes", vol.volume_id), ("snapshots", snap.snapshot_id)):
        record = driver.state / kind / f"{ident}.json"
        doc = json.loads(record.read_text())
        doc["ready"] = False
        record.write_text(json.dumps(doc))
    driver.start()
    _assert_pool_matches_the_listing(driver, client)
    assert not records(driver.state, "volumes") and not records(driver.state, "snapshots")
    assert not _pool_files(driver.pool, "snapshots")
    assert stat.S_ISDIR(os.stat(driver.pool / "volumes").st_mode)
    assert create(client, "done", size=16 * MiB).volume_id != vol.volume_id


# --- found in review: two node plugins on one kernel, concurrent publishes, long messages ---------
def test_a_restarted_node_plugin_never_adopts_another_nodes_device(driver: Driver, client: Client) -> None:
    """Two node plugins share the kernel and the pool (the local stack): node-a publishes a block
    volume read-only (its second, read-only device), node-b stages it read-write and is killed.
    Restarted, node-b adopts only devices it attached (their owner mark), so its unstage leaves
    node-a's devices attached and node-a's target still reads the volume."""
    other = start_second_node(driver)
    b = Client(other.endpoint)
    try:
        multi = block_cap(Mode.MULTI_NODE_MULTI_WRITER)
        vol = create(client, "two-nodes", size=16 * MiB, cap=multi)
        att = Attached(client, driver, vol.volume_id, multi, name="a")
        ro_target = str(driver.kubelet / "target-a-ro" / "dev")
        os.makedirs(os.path.dirname(ro_target), exist_ok=True)
        _publish(client, att, ro_target, readonly=True)
        staging_b = str(other.kubelet / "staging-b")
        b.node.NodeStageVolume(
            csi_pb2.NodeStageVolumeRequest(
                volume_id=vol.volume_id, staging_target_path=staging_b, volume_capability=multi
            )
        )
        mine = set(loop_devices_under(driver.pool))
        other.kill9()
        other.start()
        b.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging_b)
        )
        left = set(loop_devices_under(driver.pool))
        assert len(left) == len(mine) - 1, f"node-b's unstage detached {mine - left}, not only its own"
        with open(ro_target, "rb") as f:
            f.read(512)
        _unpublish(client, vol.volume_id, ro_target)
        att.close()
        assert not loop_devices_under(driver.pool)
    finally:
        b.close()
        other.stop()


def test_concurrent_publishes_never_exceed_the_nodes_limit(csi_root: Path) -> None:
    """--max-volumes-per-node 1 and two ControllerPublishVolume calls of different volumes to the
    node at once: one is published, the other RESOURCE_EXHAUSTED."""
    work = csi_root / "node-limit"
    work.mkdir()
    d = Driver(work, "all", "node-a", ["--max-volumes-per-node", "1"]).start()
    client = Client(d.endpoint)
    try:
        vols = [create(client, f"limit-{i}", size=16 * MiB) for i in range(2)]

        def publish(vol: csi_pb2.Volume) -> grpc.StatusCode:
            req = csi_pb2.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id=d.node_id, volume_capability=mount_cap()
            )
            try:
                client.controller.ControllerPublishVolume(req)
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

        with ThreadPoolExecutor(2) as pool:
            codes = sorted(pool.map(publish, vols), key=str)
        assert codes == sorted([grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED], key=str), codes
    finally:
        client.close()
        d.stop()


@pytest.mark.parametrize("char", ["x", "é", "中", "\U0001f600"])
def test_long_values_in_errors_keep_their_status_code(driver: Driver, client: Client, char: str) -> None:
    """A 5,000-character parameter key in 1-, 2-, 3- or 4-byte UTF-8 comes back as INVALID_ARGUMENT:
    the message quoting it is cut to fit gRPC's 16 KiB header once percent-encoded."""
    request = csi_pb2.CreateVolumeRequest(
        name="long-key", volume_capabilities=[mount_cap()], parameters={char * 5000: "v"}
    )
    assert code_of(lambda: client.controller.CreateVolume(request)) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_device_whose_record_cannot_be_written_is_detached_again(csi_root: Path) -> None:
    """The staging record's write right after a loop attach fails (a full state directory): the
    device is detached again, so the CO's retry cannot leave a second one behind."""
    work = Path(tempfile.mkdtemp(prefix="w", dir=csi_root))
    state = DriverState(work / "pool", work / "state")
    (work / "kubelet").mkdir()
    node = NodeServer(
        state, NodeConfig(node_id="node-a", max_volumes_per_node=0, kubelet_dir=str(work / "kubelet"))
    )

    async def attempt() -> None:
        await state.load()
        try:
            backing = state.volume_file("vol-x")
            files.create_sparse(backing, 16 * MiB)
            rec = StagingRecord(
                volume_id="vol-x", staging_path=str(work / "kubelet" / "s"), access_type="block"
            )

            async def refuse(record: StagingRecord, *, durable: bool = False) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

            state.put_staging = refuse  # type: ignore[method-assign]
            with pytest.raises(OSError):
                await node._ensure_device(rec, backing)
            assert rec.device == "" and not loop_devices_under(work)
        finally:
            state.close()

    asyncio.run(attempt())


def test_a_reader_is_not_published_to_a_second_node_while_a_single_node_writer_holds_it(
    driver: Driver, client: Client
) -> None:
    """ControllerPublishVolume weighs the modes of the nodes already holding the volume too: with
    node-a holding it SINGLE_NODE_WRITER, a MULTI_NODE_READER_ONLY publish to node-b is
    FAILED_PRECONDITION (its "ro" mount would replay node-a's live journal)."""
    other = start_second_node(driver)
    try:
        vol = create(client, "held", size=16 * MiB)
        client.controller.ControllerPublishVolume(
            csi_pb2.ControllerPublishVolumeRequest(
                volume_id=vol.volume_id, node_id="node-a", volume_capability=mount_cap()
            )
        )
        reader = csi_pb2.ControllerPublishVolumeRequest(
            volume_id=vol.volume_id,
            node_id="node-b",
            volume_capability=mount_cap(mode=Mode.MULTI_NODE_READER_ONLY),
            readonly=True,
        )
        assert code_of(lambda: client.controller.ControllerPublishVolume(reader)) == (
            grpc.StatusCode.FAILED_PRECONDITION
        )
        client.controller.ControllerUnpublishVolume(
            csi_pb2.ControllerUnpublishVolumeRequest(volume_id=vol.volume_id, node_id="node-a")
        )
        client.controller.ControllerPublishVolume(reader)  # once the writer is gone it may go
    finally:
        other.stop()


def test_two_nodes_staging_a_fresh_reader_volume_at_once_format_it_once(
    driver: Driver, client: Client
) -> None:
    """Two node plugins sharing the pool stage one fresh MULTI_NODE_READER_ONLY volume at the same
    moment: both succeed, and the volume holds one clean ext4 (the second waited for the first's
    mkfs under the backing file's lock instead of formatting over it)."""
    other = start_second_node(driver)
    b = Client(other.endpoint)
    try:
        cap = mount_cap(mode=Mode.MULTI_NODE_READER_ONLY)
        vol = create(client, "fresh-rox", size=64 * MiB, cap=cap)
        stagings = [(client, str(driver.kubelet / "staging-rox")), (b, str(other.kubelet / "staging-rox"))]

        def stage(pair: tuple[Client, str]) -> None:
            pair[0].node.NodeStageVolume(
                csi_pb2.NodeStageVolumeRequest(
                    volume_id=vol.volume_id, staging_target_path=pair[1], volume_capability=cap
                )
            )

        with ThreadPoolExecutor(2) as pool:
            list(pool.map(stage, stagings))
        for c, path in stagings:
            c.node.NodeUnstageVolume(
                csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=path)
            )
        backing = driver.pool / "volumes" / f"{vol.volume_id}.img"
        check = subprocess.run(["e2fsck", "-fn", str(backing)], capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    finally:
        b.close()
        other.stop()
