"""One test per hole of issue 17, each of which failed before the fix: request paths outside the
kubelet directory or through symlinks, a host file deleted by block unpublish, socket and state
file modes without umask games, and the registrar exiting non-zero when kubelet refuses it."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import grpc
import pytest

from csi_driver import DRIVER_NAME
from kubeloop_grpc.csi import csi_pb2
from kubeloop_grpc.pluginregistration import api_pb2, api_pb2_grpc

from ..source_tree import offenders
from .canary import mounted_under, snapshot_tree
from .conftest import Client, Driver, force_cleanup
from .volumes import Mode, block_cap, code_of, create, mount_cap

pytestmark = pytest.mark.root

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def make_canary(base: Path) -> Path:
    """A fake host: an `etc` with a passwd file, outside both the pool and the kubelet dir."""
    canary = base / "canary"
    (canary / "etc").mkdir(parents=True)
    (canary / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (canary / "data").write_bytes(b"precious host data\n")
    return canary


def stage(client: Client, volume_id: str, staging: str, cap: csi_pb2.VolumeCapability) -> None:
    client.node.NodeStageVolume(
        csi_pb2.NodeStageVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, volume_capability=cap
        )
    )


def publish(client: Client, volume_id: str, staging: str, target: str, cap: csi_pb2.VolumeCapability) -> None:
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, target_path=target, volume_capability=cap
        )
    )


def unpublish(client: Client, volume_id: str, target: str) -> None:
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
    )


def unstage(client: Client, volume_id: str, staging: str) -> None:
    client.node.NodeUnstageVolume(
        csi_pb2.NodeUnstageVolumeRequest(volume_id=volume_id, staging_target_path=staging)
    )


def test_paths_outside_the_kubelet_dir_or_through_symlinks_are_refused(
    driver: Driver, client: Client, tmp_path: Path
) -> None:
    canary = make_canary(tmp_path)
    kubelet = driver.kubelet
    dir_link, file_link = kubelet / "evil", kubelet / "evil-file"
    os.symlink(canary / "etc", dir_link)
    os.symlink(canary / "data", file_link)
    (kubelet / "pods").mkdir()
    os.symlink(canary, kubelet / "pods" / "up")
    before = snapshot_tree(canary)
    fs_vol, block_vol = (
        create(client, "confined").volume_id,
        create(client, "confined-b", cap=block_cap()).volume_id,
    )

    outside = [
        str(canary / "staging"),  # absolute, elsewhere on the host
        str(canary / "etc"),
        str(kubelet),  # the kubelet directory itself
        str(dir_link),  # a symlink out of it
        str(dir_link / "staging"),  # through a symlink out of it
        str(kubelet / "pods" / "up" / "etc"),  # through a symlink in a subdirectory
        f"{kubelet}/../canary",  # lexical escape
    ]
    for path in outside:
        assert code_of(lambda p=path: stage(client, fs_vol, p, mount_cap())) == INVALID, path

    staging, block_staging = str(kubelet / "staging"), str(kubelet / "staging-b")
    stage(client, fs_vol, staging, mount_cap())
    stage(client, block_vol, block_staging, block_cap())
    try:
        for target in [*outside, str(dir_link / "target"), str(file_link)]:
            assert code_of(lambda t=target: publish(client, fs_vol, staging, t, mount_cap())) == INVALID, (
                target
            )
            assert (
                code_of(lambda t=target: publish(client, block_vol, block_staging, t, block_cap())) == INVALID
            ), target
            assert code_of(lambda t=target: unpublish(client, fs_vol, t)) == INVALID, target
        stats = csi_pb2.NodeGetVolumeStatsRequest(volume_id=fs_vol, volume_path=str(dir_link))
        assert code_of(lambda: client.node.NodeGetVolumeStats(stats)) in (INVALID, grpc.StatusCode.NOT_FOUND)
    finally:
        unstage(client, fs_vol, staging)
        unstage(client, block_vol, block_staging)
    assert not mounted_under(canary)
    assert snapshot_tree(canary) == before, "the driver changed files outside its kubelet directory"


def test_block_unpublish_never_deletes_a_file_it_did_not_create(driver: Driver, client: Client) -> None:
    vol = create(client, "raw-keep", cap=block_cap()).volume_id
    staging = str(driver.kubelet / "staging")
    # Two targets on one node: SINGLE_NODE_MULTI_WRITER, as kubelet asks for ReadWriteOnce.
    multi = block_cap(Mode.SINGLE_NODE_MULTI_WRITER)
    stage(client, vol, staging, multi)
    existing = driver.kubelet / "pods" / "existing"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"someone else's file\n")
    made = str(driver.kubelet / "pods" / "made-by-driver")
    try:
        publish(client, vol, staging, str(existing), multi)
        publish(client, vol, staging, made, multi)
        assert stat.S_ISBLK(os.stat(existing).st_mode) and stat.S_ISBLK(os.stat(made).st_mode)
        # What the driver created is in its durable state: a restart does not forget it.
        driver.kill9()
        driver.start()
        unpublish(client, vol, str(existing))
        unpublish(client, vol, made)
    finally:
        unstage(client, vol, staging)
    assert existing.read_bytes() == b"someone else's file\n", "unpublish deleted a file it did not create"
    assert not os.path.exists(made), "unpublish must remove the target file the driver created"


def test_sockets_and_state_files_are_private_whatever_the_umask(csi_root: Path) -> None:
    work = csi_root / "modes"
    work.mkdir()
    kubelet = work / "kubelet"
    d = Driver(work, "all", "node-m", ["--kubelet-root-dir", str(kubelet)])
    old = os.umask(0)  # the driver inherits umask 0: modes must come from the driver itself
    try:
        d.launch()
    finally:
        os.umask(old)
    d.wait_ready()
    client = Client(d.endpoint)
    try:
        vol = create(client, "modes").volume_id
        snap = client.controller.CreateSnapshot(csi_pb2.CreateSnapshotRequest(name="s", source_volume_id=vol))
        staging = str(kubelet / "staging")
        stage(client, vol, staging, mount_cap())
        reg = kubelet / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"
        files = [
            d.socket,
            reg,
            d.state / ".lock",
            d.state / "volumes" / f"{vol}.json",
            d.state / "snapshots" / f"{snap.snapshot.snapshot_id}.json",
            d.state / "staging" / f"{vol}.json",
            d.pool / "nodes" / "node-m.json",
            d.pool / "volumes" / f"{vol}.img",
            d.pool / "snapshots" / f"{snap.snapshot.snapshot_id}.img",
        ]
        modes = {str(f): oct(stat.S_IMODE(os.lstat(f).st_mode)) for f in files}
        assert modes == {str(f): "0o600" for f in files}
        assert stat.S_IMODE(os.stat(d.state).st_mode) == 0o700
        assert stat.S_ISSOCK(os.lstat(d.socket).st_mode) and stat.S_ISSOCK(os.lstat(reg).st_mode)
        # The private directories the sockets were bound in are gone.
        assert [p.name for p in work.iterdir() if p.name.startswith(".")] == []
        assert [p.name for p in reg.parent.iterdir()] == [reg.name]
        unstage(client, vol, staging)
    finally:
        client.close()
        assert d.stop() == 0
        force_cleanup(work)
    assert not d.socket.exists()


def test_no_process_wide_umask_in_shipped_code() -> None:
    """os.umask is process-wide: a task changing it races every other task creating files."""
    assert offenders(r"\bumask\s*\(") == []


def test_registrar_exits_nonzero_when_kubelet_reports_failure(csi_root: Path) -> None:
    work = csi_root / "refused"
    work.mkdir()
    kubelet = work / "kubelet"
    d = Driver(work, "node", "node-f", ["--kubelet-root-dir", str(kubelet)]).start()
    reg = kubelet / "plugins_registry" / f"{DRIVER_NAME}-reg.sock"
    try:
        with grpc.insecure_channel(f"unix://{reg}") as ch:
            stub = api_pb2_grpc.RegistrationStub(ch)
            assert stub.GetInfo(api_pb2.InfoRequest(), timeout=5).name == DRIVER_NAME
            stub.NotifyRegistrationStatus(
                api_pb2.RegistrationStatus(plugin_registered=False, error="unsupported version"), timeout=5
            )
        assert d.proc is not None
        code = d.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        d.stop()
        pytest.fail("the node plugin kept running after kubelet reported registration failure")
    assert code == 1, f"exit code {code}"
    assert "unsupported version" in d.log.read_text()
    assert not d.socket.exists() and not reg.exists()
