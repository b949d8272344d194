"""A loop device is matched to its backing file by path, or by device and inode when the kernel
prints the path from another mount namespace (a node plugin container restarted)."""

from __future__ import annotations

import os
from pathlib import Path

from csi_driver.backend.loop import LoopDevice


def _device(back_file: str, path: Path | None = None) -> LoopDevice:
    dev, ino = "", 0
    if path is not None:
        st = os.stat(path)
        dev, ino = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", st.st_ino
    return LoopDevice("/dev/loop7", back_file, direct_io=True, read_only=False, back_dev=dev, back_ino=ino)


def test_same_path_matches(tmp_path: Path) -> None:
    f = tmp_path / "vol-1.img"
    f.write_bytes(b"")
    assert _device(str(f)).backed_by(str(f))


def test_path_from_another_namespace_matches_by_inode(tmp_path: Path) -> None:
    f = tmp_path / "vol-1.img"
    f.write_bytes(b"")
    assert _device("/volumes/vol-1.img", f).backed_by(str(f))


def test_other_file_does_not_match(tmp_path: Path) -> None:
    a, b = tmp_path / "vol-a.img", tmp_path / "vol-b.img"
    a.write_bytes(b"")
    b.write_bytes(b"")
    assert not _device("/volumes/vol-a.img", a).backed_by(str(b))
    assert not _device("/volumes/vol-a.img").backed_by(str(a))  # no inode recorded: path only
    assert not _device("/volumes/vol-a.img", a).backed_by(str(tmp_path / "missing.img"))
