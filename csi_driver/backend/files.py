"""Backing files in the pool: create sparse, copy keeping holes, grow, remove, fsync'd.

These are plain blocking functions; callers run them with asyncio.to_thread.
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

from controller_runtime.files import fsync_dir, temp_name

# ioctl FICLONE: a reflink copy, instant and sharing extents, where the filesystem can (btrfs, xfs).
_FICLONE = 0x40049409
_CHUNK = 64 << 20
# ioctl FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (declared with a long, but every filesystem reads and
# writes an int) and the inode flag FS_SYNC_FL, chattr's "S": the filesystem completes every
# write to the file only once it is on disk, whoever writes it (a loop device too).
_FS_IOC_GETFLAGS = 0x80086601
_FS_IOC_SETFLAGS = 0x40086602
_FS_SYNC_FL = 0x00000008


class UnsafePoolFile(OSError):
    """A backing file that is not a regular file reached without a symlink."""


def open_regular(path: str, flags: int) -> int:
    """Opens `path` (absolute, its directories free of symlinks) only if it is a regular file
    reached without following any symlink.

    Whoever can write the pool is trusted less than the driver: a `volumes/x.img` that is a
    symlink, or a `volumes` directory swapped for one, must not make the driver read, grow or
    attach a file elsewhere. The path is pinned first (O_PATH, which follows nothing and never
    blocks on a FIFO), checked by what the kernel says it reached, then reopened with `flags`.
    """
    pin = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        mode = os.fstat(pin).st_mode
        if not stat.S_ISREG(mode):
            kind = "a symlink" if stat.S_ISLNK(mode) else "not a regular file"
            raise UnsafePoolFile(errno.ELOOP if stat.S_ISLNK(mode) else errno.EINVAL, f"{path} is {kind}")
        reached = os.readlink(f"/proc/self/fd/{pin}")
        if reached != path:
            raise UnsafePoolFile(errno.ELOOP, f"{path} leads to {reached} through a symlink")
        return os.open(f"/proc/self/fd/{pin}", flags | os.O_CLOEXEC)
    finally:
        os.close(pin)


def lock_exclusive(path: str) -> int:
    """Opens a pool file and takes an exclusive flock on it, waiting for whoever holds it (another
    process sharing the pool); returns the descriptor, whose close releases the lock."""
    return flocked(open_regular(path, os.O_RDONLY))


def flocked(fd: int) -> int:
    """Takes an exclusive flock on an open descriptor, waiting for whoever holds it; returns the
    descriptor, whose close releases the lock (closed here when the wait fails)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def holds_data(path: str) -> bool:
    """Whether a backing file has any allocated data: False for one that is all hole (a new
    volume, or a copy of one). Where the filesystem cannot say where the holes are (no
    SEEK_DATA, or one that calls the whole file data), a file with no block allocated holds
    none and any other holds some."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        try:
            first_data = os.lseek(fd, 0, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data anywhere
                return False
            return st.st_blocks > 0
        if first_data == 0 and os.lseek(fd, 0, os.SEEK_HOLE) >= st.st_size:
            return st.st_blocks > 0
        return True
    finally:
        os.close(fd)


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


def extents(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The allocated (offset, length) ranges of an open file between `start` and `end`, from
    SEEK_DATA and SEEK_HOLE: what a sparse file holds, without reading it. Shared by the local
    copies here and the node-to-node transfer (csi_driver.transfer), which sends only these."""
    offset = start
    while offset < end:
        try:
            first = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # no data after offset
                return
            raise
        if first >= end:
            return
        last = min(os.lseek(fd, first, os.SEEK_HOLE), end)
        yield first, last - first
        offset = last


def _copy_data_ranges(src: int, dst: int, size: int) -> None:
    """Copies only the allocated ranges of src; holes stay holes in dst."""
    for start, length in extents(src, 0, size):
        pos, end = start, start + length
        while pos < end:
            n = os.copy_file_range(src, dst, min(_CHUNK, end - pos), pos, pos)
            if n == 0:
                break
            pos += n


def copy_sparse(src_path: str, dst_path: str, size: int) -> None:
    """Copies src to dst (atomically, temp + rename) keeping holes, then sets dst's size to `size`
    (a clone or restore may be larger than its source)."""
    tmp = temp_name(dst_path)
    src = open_regular(src_path, os.O_RDONLY)
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
    fd = open_regular(path, os.O_WRONLY)
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


def _inode_flags(fd: int) -> int:
    flags = array.array("i", [0])
    fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags, True)
    return flags[0]


def set_synchronous(path: str, on: bool) -> None:
    """Sets or clears a backing file's synchronous-write flag (FS_SYNC_FL), durably. It acts at
    once on a loop device already bound to the file: each write the device passes down completes
    only when it has reached the pool's disk."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        old = _inode_flags(fd)
        new = old | _FS_SYNC_FL if on else old & ~_FS_SYNC_FL
        if new != old:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, array.array("i", [new]))
            os.fsync(fd)  # the inode, flag included, is on disk before the change is recorded
    finally:
        os.close(fd)


def synchronous(path: str) -> bool:
    """Whether a backing file carries the synchronous-write flag."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        return bool(_inode_flags(fd) & _FS_SYNC_FL)
    finally:
        os.close(fd)


def data_ranges(path: str, start: int, end: int) -> list[tuple[int, int]]:
    """The allocated (offset, length) ranges of a backing file between `start` and `end`."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        return list(extents(fd, start, end))
    finally:
        os.close(fd)


def changed_ranges(base: str, target: str, start: int, end: int, block: int) -> list[tuple[int, int]]:
    """The `block`-sized blocks that differ between two backing files between `start` and `end`,
    merged into (offset, length) runs. Only what either file holds is read: a hole in both is
    zeros in both."""
    candidates = sorted(data_ranges(base, start, end) + data_ranges(target, start, end))
    a, b = open_regular(base, os.O_RDONLY), open_regular(target, os.O_RDONLY)
    try:
        runs: list[tuple[int, int]] = []
        done = start
        for offset, length in candidates:
            pos = max(done, offset - offset % block)  # block-aligned: `done` only grows by blocks
            hi = min(end, offset + length)
            while pos < hi:
                n = min(_CHUNK, hi - pos)
                n = min(n + (-n) % block, end - pos)  # whole blocks, never past the end
                left, right = os.pread(a, n, pos), os.pread(b, n, pos)
                for i in range(0, n, block):
                    if left[i : i + block] != right[i : i + block]:
                        size = min(block, end - pos - i)
                        if runs and runs[-1][0] + runs[-1][1] == pos + i:
                            runs[-1] = (runs[-1][0], runs[-1][1] + size)
                        else:
                            runs.append((pos + i, size))
                pos += n
            done = max(done, pos)
        return runs
    finally:
        os.close(a)
        os.close(b)
