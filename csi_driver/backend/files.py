"""Backing files in the pool: create sparse, copy keeping holes, grow, remove, fsync'd.

These are plain blocking functions; callers run them with asyncio.to_thread.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from controller_runtime.files import fsync_dir, temp_name

# ioctl FICLONE: a reflink copy, instant and sharing extents, where the filesystem can (btrfs, xfs).
_FICLONE = 0x40049409
_CHUNK = 64 << 20


def create_sparse(path: str, size: int) -> None:
    """Creates `path` as a sparse file of `size` bytes, atomically (temp file + rename)."""
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))


def _copy_data_ranges(src: int, dst: int, size: int) -> None:
    """Copies only the allocated ranges of src (SEEK_DATA/SEEK_HOLE); holes stay holes in dst."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(src, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after offset
                return
            raise
        end = os.lseek(src, start, os.SEEK_HOLE)
        pos = start
        while pos < end:
            n = os.copy_file_range(src, dst, min(_CHUNK, end - pos), pos, pos)
            if n == 0:
                break
            pos += n
        offset = end


def copy_sparse(src_path: str, dst_path: str, size: int) -> None:
    """Copies src to dst (atomically, temp + rename) keeping holes, then sets dst's size to `size`
    (a clone or restore may be larger than its source)."""
    tmp = temp_name(dst_path)
    src = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            src_size = os.fstat(src).st_size
            try:
                fcntl.ioctl(dst, _FICLONE, src)
            except OSError:
                os.ftruncate(dst, src_size)
                _copy_data_ranges(src, dst, src_size)
            os.ftruncate(dst, max(size, src_size))
            os.fsync(dst)
        finally:
            os.close(dst)
    finally:
        os.close(src)
    os.rename(tmp, dst_path)
    fsync_dir(os.path.dirname(dst_path))


def grow(path: str, size: int) -> None:
    """Extends a backing file to `size` (never shrinks it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
            os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str) -> None:
    # A temporary copy of a killed CreateVolume is the controller's start-up sweep's to remove.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fsync_dir(os.path.dirname(path))


def free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
