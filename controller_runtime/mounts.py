"""The mount table: /proc/self/mountinfo parsed, and whether a path is a mount point. Read by the
node agent (what is still mounted after a restart or an unpublish) and by the CSI driver's node
service; mounting and unmounting belong to the driver (csi_driver/backend/mounts.py).

Whether one path is a mount point is asked of the kernel for that path (statx's mount-root
attribute): reading the table costs time in proportion to every mount on the machine, a few
milliseconds at a thousand mounts, and a node plugin asks several times per call."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import libc

_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


@dataclass(frozen=True)
class Mount:
    mountpoint: str
    root: str  # the path inside the source filesystem that is mounted (a bind of a file shows it)
    fs_type: str
    source: str
    options: frozenset[str]
    major_minor: str

    @property
    def read_only(self) -> bool:
        return "ro" in self.options


def parse_mountinfo(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 2:
            continue
        opts = set(fields[5].split(","))
        if len(tail) > 2:
            opts |= set(tail[2].split(","))
        mounts.append(
            Mount(
                mountpoint=_unescape(fields[4]),
                root=_unescape(fields[3]),
                fs_type=tail[0],
                source=_unescape(tail[1]),
                options=frozenset(opts),
                major_minor=fields[2],
            )
        )
    return mounts


def read_mounts() -> list[Mount]:
    """The mount table of this process' namespace. A procfs read never blocks on I/O."""
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())


def _escape(path: str) -> str:
    return path.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def mounts_at(path: str, table: Sequence[Mount] | None = None) -> list[Mount]:
    path = os.path.normpath(path)
    if table is None:
        with open("/proc/self/mountinfo") as f:
            text = f.read()
        # Most asks are of one path among hundreds of mounts: a path that appears nowhere in the
        # text, as mountinfo escapes it, is no mount point, and nothing needs parsing.
        if f" {_escape(path)} " not in text:
            return []
        table = parse_mountinfo(text)
    return [m for m in table if m.mountpoint == path]


def is_mounted(path: str, table: Sequence[Mount] | None = None) -> bool:
    """Whether `path` (as written, symlinks not followed) is a mount point: in `table` when one is
    given (one snapshot for many questions), else by asking the kernel, or the table where the
    kernel cannot say."""
    if table is None:
        answer = _mount_root(path)
        if answer is not None:
            return answer
    return bool(mounts_at(path, table))


# statx(2): the mount-root attribute exists since Linux 5.8; struct statx's fixed offsets.
_AT_FDCWD = -100
_AT_SYMLINK_NOFOLLOW = 0x100
_AT_NO_AUTOMOUNT = 0x800
_AT_STATX_DONT_SYNC = 0x4000  # cached attributes: a hung FUSE or NFS server is never asked
_STATX_TYPE = 0x1
_STATX_ATTR_MOUNT_ROOT = 0x2000
_ATTRIBUTES = slice(8, 16)
_ATTRIBUTES_MASK = slice(56, 64)
_ABSENT = (errno.ENOENT, errno.ENOTDIR)


def _load_statx() -> Callable[..., int] | None:
    fn = libc.function("statx")
    if fn is not None:
        fn.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p)
    return fn


_statx = _load_statx()


def _mount_root(path: str) -> bool | None:
    """The kernel's word on whether `path` is the root of a mount, or None where it cannot answer
    for `path` as the table reads it (normalised, nothing followed): a relative path or one with a
    NUL, or a symlink among the parents, which the kernel would follow; no statx or no mount-root
    attribute (an old kernel, a seccomp filter); or an error other than "no such path" (a dead FUSE
    mount still has its line in the table).

    Where a mount was made over one of the path's parents, the path's own mount is hidden: the
    kernel answers for the path as it now resolves (not a mount point, as kubelet's check says),
    while the table still lists the hidden mount. Only the host's root can stack mounts like that."""
    global _statx
    statx = _statx  # one read: another thread may switch it off meanwhile
    if statx is None or not os.path.isabs(path) or "\0" in path:
        return None
    path = os.path.normpath(path)
    if os.path.realpath(os.path.dirname(path)) != os.path.dirname(path):
        return None
    buf = ctypes.create_string_buffer(256)
    flags = _AT_SYMLINK_NOFOLLOW | _AT_NO_AUTOMOUNT | _AT_STATX_DONT_SYNC
    if statx(_AT_FDCWD, os.fsencode(path), flags, _STATX_TYPE, buf) != 0:
        err = ctypes.get_errno()
        if err in _ABSENT:
            return False
        if err == errno.ENOSYS:
            _statx = None  # never there: the table from now on
        return None
    raw = buf.raw
    if not int.from_bytes(raw[_ATTRIBUTES_MASK], sys.byteorder) & _STATX_ATTR_MOUNT_ROOT:
        _statx = None  # a kernel before 5.8
        return None
    return bool(int.from_bytes(raw[_ATTRIBUTES], sys.byteorder) & _STATX_ATTR_MOUNT_ROOT)
