"""Mount options split the way mount(8) splits them, and the filesystems kubeloop makes recognised
from their superblocks as blkid names them (real mkfs images in a temporary directory)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from csi_driver.backend import fs, syscalls
from csi_driver.backend.fs import Signature
from csi_driver.backend.syscalls import MS_NOATIME, MS_NODEV, MS_NOSUID, MS_RDONLY, parse_options
from csi_driver.backend.tools import ToolError


def test_generic_options_become_flags_and_the_rest_goes_to_the_filesystem() -> None:
    opts = parse_options(["ro", "noatime,discard", "nosuid", "errors=remount-ro", "defaults"])
    assert opts.flags == MS_RDONLY | MS_NOATIME | MS_NOSUID
    assert opts.data == "discard,errors=remount-ro"


def test_a_later_option_wins_over_a_contrary_earlier_one() -> None:
    assert parse_options(["ro", "rw", "nodev"]).flags == MS_NODEV
    assert parse_options(["atime,noatime"]).flags == MS_NOATIME
    assert parse_options([]) == syscalls.MountOptions(0, "")


def test_a_failed_mount_says_what_was_asked_and_the_kernels_answer(tmp_path: Path) -> None:
    with pytest.raises(ToolError) as err:
        syscalls.mount(str(tmp_path / "missing-device"), str(tmp_path), "ext4", ["ro"])
    text = str(err.value)
    assert "mount -t ext4 -o ro" in text and "missing-device" in text and "errno" in text


def _mkfs(tmp_path: Path, fs_type: str, size_mi: int, *extra: str) -> Path:
    tool = shutil.which(f"mkfs.{fs_type}", path="/usr/sbin:/sbin:/usr/bin")
    assert tool, f"mkfs.{fs_type} is missing: install e2fsprogs and xfsprogs (make deps)"
    image = tmp_path / f"{fs_type}.img"
    with image.open("wb") as f:
        f.truncate(size_mi << 20)
    force = "-f" if fs_type == "xfs" else "-F"
    subprocess.run([tool, "-q", force, *extra, str(image)], check=True, capture_output=True)
    return image


def _blkid(image: Path) -> str:
    tool = shutil.which("blkid", path="/usr/sbin:/sbin:/usr/bin")
    assert tool, "blkid is missing: install util-linux"
    return subprocess.run(
        [tool, "-p", "-o", "value", "-s", "TYPE", str(image)], capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.parametrize(
    ("fs_type", "extra"),
    [("ext4", ()), ("ext4", ("-O", "^metadata_csum,^64bit")), ("ext3", ()), ("ext2", ()), ("xfs", ())],
)
async def test_the_filesystems_kubeloop_makes_are_named_as_blkid_names_them(
    tmp_path: Path, fs_type: str, extra: tuple[str, ...]
) -> None:
    image = _mkfs(tmp_path, fs_type, 320 if fs_type == "xfs" else 64, *extra)
    assert await fs.probe(str(image)) == Signature(fs_type=_blkid(image)) == Signature(fs_type=fs_type)
    if fs_type.startswith("ext"):
        assert await fs.ext_size(str(image)) == 64 << 20


async def test_anything_else_is_left_to_blkid(tmp_path: Path) -> None:
    blank = tmp_path / "blank.img"
    with blank.open("wb") as f:
        f.truncate(16 << 20)
    assert fs.known_signature(blank.read_bytes()[:2048]) is None
    assert (await fs.probe(str(blank))).blank
    with pytest.raises(ToolError, match="no ext2/3/4 superblock"):
        await fs.ext_size(str(blank))
