"""An offline ext4 grow killed midway. Where the node plugin lacks CAP_SYS_RESOURCE, a volume
expanded while unstaged is grown by resize2fs at the next NodeStageVolume, unmounted; kill the
plugin then and resize2fs leaves the resize inode and the free-block counts wrong, which e2fsck -p
refuses to repair. The plugin records the grow before it starts, so the next NodeStageVolume (or a
NodeUnstageVolume, when the pod went away meanwhile) repairs that damage and finishes the grow.

The kill is real and lands at a chosen write, not a chosen time (resize2fs can finish this grow in
30 ms, quicker than a timer is reliable): a stand-in resize2fs on the plugin's PATH runs the real one
under strace, which delivers SIGKILL on entry to its Nth pwrite64, then kills the plugin. N is a
fraction of the writes the same grow makes on a throw-away image."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import grpc
import pytest

from kubeloop_grpc.csi import csi_pb2
from tests.csi.conftest import Client, Driver, stop_and_clean

from .volumes import Attached, create, expand, fs_bytes, mount_cap, read_digest, write_data

MiB = 1 << 20
SIZE, GROWN = 128 * MiB, 16 << 30
# At which of resize2fs's writes to kill it, as fractions of the writes a whole grow makes; any
# write before the last superblock update leaves counts e2fsck -p refuses, the later ones the more
# so (the group descriptors, then the superblock).
FRACTIONS = (0.9, 0.5, 0.75, 0.95, 0.25)

STAND_IN = """#!/bin/sh
strace -f -qq -o /dev/null -e trace=pwrite64 -e inject=pwrite64:signal=KILL:when="$KILL_AT" \\
  "$REAL_RESIZE2FS" "$@"
kill -9 "$PPID"
exit 137
"""


def resize_writes(scratch: Path) -> int:
    """How many pwrite64 calls resize2fs makes for this grow, from a throw-away image."""
    image = scratch / "measure.img"
    with open(image, "wb") as f:
        f.truncate(SIZE)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
    with open(image, "r+b") as f:
        f.truncate(GROWN)
    subprocess.run(["e2fsck", "-f", "-p", str(image)], check=True, capture_output=True)
    trace = scratch / "measure.trace"
    subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=pwrite64", "resize2fs", str(image)],
        check=True,
        capture_output=True,
    )
    writes = sum(1 for line in trace.read_text().splitlines() if "pwrite64(" in line)
    image.unlink()
    return writes


def fsck_clean(image: Path) -> bool:
    return subprocess.run(["e2fsck", "-f", "-n", str(image)], capture_output=True).returncode == 0


def test_a_killed_offline_grow_is_repaired_and_finished(csi_root: Path) -> None:
    real = shutil.which("resize2fs")
    assert real, "resize2fs is missing: install e2fsprogs"
    assert shutil.which("strace"), "strace is missing: make deps installs it"
    work = Path(tempfile.mkdtemp(prefix="g", dir=csi_root))
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "resize2fs").write_text(STAND_IN)
    os.chmod(bin_dir / "resize2fs", stat.S_IRWXU)
    writes = resize_writes(work)
    assert writes > 10, f"resize2fs made {writes} pwrite64 calls for a 128 MiB to 16 GiB grow"
    plain = Driver(work)
    damaged_at: list[float] = []
    try:
        for i, fraction in enumerate(FRACTIONS):
            env = {
                **os.environ,
                "PATH": f"{bin_dir}:{os.environ['PATH']}",
                "REAL_RESIZE2FS": real,
                "KILL_AT": str(max(1, int(writes * fraction))),
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
            f"no kill in {len(FRACTIONS)} tries (at fractions of {writes} writes) left a damaged "
            "filesystem: the repair path was not exercised"
        )
        assert "repairing a filesystem whose offline grow was interrupted" in plain.log.read_text()
    finally:
        stop_and_clean(plain, work)
