"""files.open_regular: a pool file is opened only as a regular file reached without a symlink
(issue 29, hole 6). Real files in a temporary directory; no root needed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csi_driver.backend.files import UnsafePoolFile, open_regular


def _read(path: Path) -> bytes:
    fd = open_regular(str(path), os.O_RDONLY)
    try:
        return os.pread(fd, 100, 0)
    finally:
        os.close(fd)


@pytest.fixture
def pool(tmp_path: Path) -> Path:
    root = tmp_path.resolve() / "pool"
    (root / "volumes").mkdir(parents=True)
    (root / "volumes" / "vol-a.img").write_bytes(b"volume data")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "vol-a.img").write_bytes(b"secret")
    return root


def test_a_regular_file_opens(pool: Path) -> None:
    assert _read(pool / "volumes" / "vol-a.img") == b"volume data"


def test_a_symlinked_file_is_refused(pool: Path) -> None:
    link = pool / "volumes" / "vol-b.img"
    link.symlink_to(pool.parent / "outside" / "vol-a.img")
    with pytest.raises(UnsafePoolFile, match="symlink"):
        _read(link)


def test_a_directory_swapped_for_a_symlink_is_refused(pool: Path) -> None:
    (pool / "volumes").rename(pool / "old-volumes")
    (pool / "volumes").symlink_to(pool.parent / "outside")
    with pytest.raises(UnsafePoolFile, match="through a symlink"):
        _read(pool / "volumes" / "vol-a.img")


def test_special_files_are_refused_without_blocking(pool: Path) -> None:
    fifo = pool / "volumes" / "vol-c.img"
    os.mkfifo(fifo)  # an O_RDONLY open of a FIFO would wait for a writer forever
    with pytest.raises(UnsafePoolFile, match="not a regular file"):
        _read(fifo)
    with pytest.raises(UnsafePoolFile, match="not a regular file"):
        _read(pool / "volumes")
