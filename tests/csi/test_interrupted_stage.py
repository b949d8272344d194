"""A NodeStageVolume killed midway, retried (found by the driver bench at concurrency 2,
docs/driver-bench.md).

- Killed during mkfs.xfs: from its tenth write on, mkfs.xfs has left a superblock blkid recognises
  on a filesystem that does not mount ("Structure needs cleaning"). The stage recorded that it was
  formatting before it began, so the retry makes the filesystem again instead of mounting the
  half-made one. The kill is real and lands at a chosen write: a stand-in mkfs.xfs on the plugin's
  PATH runs the real one under strace, which delivers SIGKILL on entry to its Nth pwrite64, then
  kills the plugin.
- Killed after the mount, before the record said so: the retry finds the staging mounted and
  learns the filesystem from the mount, so an expansion finds it and a later stage does not take
  the finished filesystem for a half-made one.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2
from tests.csi.conftest import Client, Driver, stop_and_clean

from .volumes import MiB, create, mount_cap, read_digest, write_data

STAND_IN = """#!/bin/sh
strace -f -qq -o /dev/null -e trace=pwrite64 -e inject=pwrite64:signal=KILL:when="$KILL_AT" \\
  "$REAL_MKFS" "$@"
kill -9 "$PPID"
exit 137
"""
XFS = mount_cap("xfs")


def stage_request(driver: Driver, volume_id: str, staging: str) -> csi_pb2.NodeStageVolumeRequest:
    return csi_pb2.NodeStageVolumeRequest(
        volume_id=volume_id,
        staging_target_path=staging,
        volume_capability=XFS,
        publish_context={"loop.csi.kubeloop.dev/backing-file": f"volumes/{volume_id}.img"},
    )


def use(client: Client, volume_id: str, staging: str, target: str) -> str:
    """Publishes the staged volume, writes through it; the data's digest."""
    client.node.NodePublishVolume(
        csi_pb2.NodePublishVolumeRequest(
            volume_id=volume_id, staging_target_path=staging, target_path=target, volume_capability=XFS
        )
    )
    digest = write_data(target)
    assert read_digest(target) == digest
    client.node.NodeUnpublishVolume(
        csi_pb2.NodeUnpublishVolumeRequest(volume_id=volume_id, target_path=target)
    )
    return digest


@pytest.mark.parametrize("kill_at", [10, 40])
def test_a_stage_killed_during_mkfs_makes_the_filesystem_again(csi_root: Path, kill_at: int) -> None:
    real = shutil.which("mkfs.xfs")
    assert real, "mkfs.xfs is missing: install xfsprogs"
    assert shutil.which("strace"), "strace is missing: make deps installs it"
    work = Path(tempfile.mkdtemp(prefix="m", dir=csi_root))
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "mkfs.xfs").write_text(STAND_IN)
    os.chmod(bin_dir / "mkfs.xfs", stat.S_IRWXU)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "REAL_MKFS": real,
        "KILL_AT": str(kill_at),
    }
    killer = Driver(work, env=env).start()
    plain = Driver(work)
    try:
        client = Client(killer.endpoint)
        vol = create(client, "fresh", size=320 * MiB, cap=XFS)
        staging, target = str(work / "kubelet" / "staging"), str(work / "kubelet" / "target" / "mount")
        os.makedirs(staging)
        os.makedirs(os.path.dirname(target))
        with pytest.raises(grpc.RpcError):
            client.node.NodeStageVolume(stage_request(killer, vol.volume_id, staging))
        assert killer.proc is not None and killer.proc.wait(timeout=30) == -9
        client.close()

        plain.start()
        client = Client(plain.endpoint)
        client.node.NodeStageVolume(stage_request(plain, vol.volume_id, staging))
        use(client, vol.volume_id, staging, target)
        client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
        )
        client.close()
    finally:
        stop_and_clean(plain, work)


def test_a_stage_killed_after_its_mount_is_completed_by_the_retry(csi_root: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="n", dir=csi_root))
    d = Driver(work).start()
    try:
        client = Client(d.endpoint)
        vol = create(client, "mounted", size=320 * MiB, cap=XFS)
        staging, target = str(work / "kubelet" / "staging"), str(work / "kubelet" / "target" / "mount")
        os.makedirs(staging)
        os.makedirs(os.path.dirname(target))
        client.node.NodeStageVolume(stage_request(d, vol.volume_id, staging))
        client.close()
        d.kill9()
        # What a kill between the mount and the record's update leaves: mounted, the record still
        # as it was written before mkfs.
        record = work / "state" / "staging" / f"{vol.volume_id}.json"
        doc = json.loads(record.read_text())
        record.write_text(json.dumps({**doc, "fs_type": "", "formatting": True}))

        d.start()
        client = Client(d.endpoint)
        client.node.NodeStageVolume(stage_request(d, vol.volume_id, staging))
        doc = json.loads(record.read_text())
        assert (doc["fs_type"], doc["formatting"]) == ("xfs", False)
        digest = use(client, vol.volume_id, staging, target)
        client.node.NodeExpandVolume(
            csi_pb2.NodeExpandVolumeRequest(
                volume_id=vol.volume_id, volume_path=staging, staging_target_path=staging
            )
        )
        # Unstaged and staged again: the filesystem is kept, its data with it.
        client.node.NodeUnstageVolume(
            csi_pb2.NodeUnstageVolumeRequest(volume_id=vol.volume_id, staging_target_path=staging)
        )
        client.node.NodeStageVolume(stage_request(d, vol.volume_id, staging))
        client.node.NodePublishVolume(
            csi_pb2.NodePublishVolumeRequest(
                volume_id=vol.volume_id,
                staging_target_path=staging,
                target_path=target,
                volume_capability=XFS,
            )
        )
        assert read_digest(target) == digest
        client.close()
    finally:
        stop_and_clean(d, work)
