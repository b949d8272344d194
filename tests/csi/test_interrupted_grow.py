"""An offline ext4 grow killed midway. Where the node plugin lacks CAP_SYS_RESOURCE, a volume
expanded while unstaged is grown by resize2fs at the next NodeStageVolume, unmounted; kill the
plugin then and resize2fs leaves the resize inode and the free-block counts wrong, which e2fsck -p
refuses to repair. The plugin records the grow before it starts, so the next NodeStageVolume (or a
NodeUnstageVolume, when the pod went away meanwhile) repairs that damage and finishes the grow.

The kill is real: a stand-in resize2fs on the plugin's PATH starts the real one, and after a
chosen fraction of its measured run time kills it and the plugin with SIGKILL."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2
from tests.csi.conftest import Client, Driver, stop_and_clean
from tests.csi.test_driver import Attached, create, expand, fs_bytes, mount_cap, read_digest, write_data

MiB = 1 << 20
SIZE, GROWN = 128 * MiB, 16 << 30
# Where in resize2fs's run to kill it: its last writes (group descriptors, then the superblock)
# are the damaging window, so the late fractions come first.
FRACTIONS = (0.85, 0.95, 0.75, 0.9, 0.65, 0.8, 0.98, 0.7, 0.55, 0.6)

STAND_IN = """#!/bin/sh
"$REAL_RESIZE2FS" "$@" &
real=$!
sleep "$KILL_AFTER"
kill -9 "$real" "$PPID"
wait "$real"
exit 137
"""


def resize_seconds(scratch: Path) -> float:
    """How long resize2fs takes for this grow on this machine, from a throw-away image."""
    image = scratch / "measure.img"
    with open(image, "wb") as f:
        f.truncate(SIZE)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    with open(image, "r+b") as f:
        f.truncate(GROWN)
    subprocess.run(["e2fsck", "-f", "-p", str(image)], check=True, capture_output=True)
    start = time.monotonic()
    subprocess.run(["resize2fs", str(image)], check=True, capture_output=True)
    took = time.monotonic() - start
    image.unlink()
    return took


def fsck_clean(image: Path) -> bool:
    return subprocess.run(["e2fsck", "-f", "-n", str(image)], capture_output=True).returncode == 0


def test_a_killed_offline_grow_is_repaired_and_finished(csi_root: Path) -> None:
    real = shutil.which("resize2fs")
    assert real, "resize2fs is missing: install e2fsprogs"
    work = Path(tempfile.mkdtemp(prefix="g", dir=csi_root))
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "resize2fs").write_text(STAND_IN)
    os.chmod(bin_dir / "resize2fs", stat.S_IRWXU)
    took = resize_seconds(work)
    plain = Driver(work)
    damaged_at: list[float] = []
    try:
        for i, fraction in enumerate(FRACTIONS):
            env = {
                **os.environ,
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "REAL_RESIZE2FS": real,
                "KILL_AFTER": f"{took * fraction:.4f}",
            }
            killer = Driver(work, env=env).start()
            client = Client(killer.endpoint)
            vol = create(client, f"grow-{i}", size=SIZE, cap=mount_cap("ext4"))
            att = Attached(client, killer, vol.volume_id, mount_cap("ext4"), name=f"g{i}")
            digest = write_data(att.target)
            att.unpublish()
            att.unstage()
            assert expand(client, vol.volume_id, GROWN).node_expansion_required
            with pytest.raises(grpc.RpcError):
                att.stage()  # the stand-in kills the plugin in the middle of the grow
            assert killer.proc is not None and killer.proc.wait(timeout=30) == -9
            client.close()

            image = work / "pool" / "volumes" / f"{vol.volume_id}.img"
            damaged = not fsck_clean(image)
            plain.start()
            att.client = client = Client(plain.endpoint)
            if damaged:
                damaged_at.append(fraction)
                if len(damaged_at) == 1:
                    # The pod went away meanwhile: the unstage finishes the grow before it forgets.
                    att.unstage()
                    assert fsck_clean(image), "NodeUnstageVolume left the interrupted grow unrepaired"
            att.stage()
            att.publish()
            assert read_digest(att.target) == digest
            assert fs_bytes(att.target) > GROWN // 2
            att.close()
            client.controller.DeleteVolume(csi_pb2.DeleteVolumeRequest(volume_id=vol.volume_id))
            client.close()
            plain.stop()
            if len(damaged_at) == 2:
                break
        assert damaged_at, (
            f"no kill in {len(FRACTIONS)} tries (resize2fs took {took:.3f} s) left a damaged "
            "filesystem: the repair path was not exercised"
        )
        assert "repairing a filesystem whose offline grow was interrupted" in plain.log.read_text()
    finally:
        stop_and_clean(plain, work)
