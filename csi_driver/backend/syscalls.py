"""mount(2) and umount2(2) through libc, for the node plugin's hot path: a stage or publish used to
fork mount(8) once or twice per volume, and with a few hundred volumes staged at once the forks of
a 100 MB Python process were most of the plugin's CPU (docs/benchmarks.md, "Profiling").

Only what mount(8) itself would do for our calls is done here: the generic options mount(8) turns
into MS_* flags are turned into the same flags, every other option is handed to the filesystem as
its data string, and no path is canonicalised (callers pass `/proc/self/fd/<fd>` paths of
descriptors opened without following symlinks, as they did with `mount --no-canonicalize`).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

from controller_runtime.libc import LIBC

from .tools import ToolError

if LIBC is None:
    raise ImportError("the node plugin mounts through the C library, and ctypes cannot load one")
_libc = LIBC
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_SYNCHRONOUS = 16
MS_REMOUNT = 32
MS_MANDLOCK = 64
MS_DIRSYNC = 128
MS_NOSYMFOLLOW = 256
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_SILENT = 32768
MS_RELATIME = 1 << 21
MS_STRICTATIME = 1 << 24
MS_LAZYTIME = 1 << 25

# mount(8)'s generic options: (flags set, flags cleared). "defaults" and the options that only
# mean something to mount(8) itself (auto, user, _netdev, ...) are dropped as it drops them.
_GENERIC: dict[str, tuple[int, int]] = {
    "defaults": (0, 0),
    "rw": (0, MS_RDONLY),
    "ro": (MS_RDONLY, 0),
    "suid": (0, MS_NOSUID),
    "nosuid": (MS_NOSUID, 0),
    "dev": (0, MS_NODEV),
    "nodev": (MS_NODEV, 0),
    "exec": (0, MS_NOEXEC),
    "noexec": (MS_NOEXEC, 0),
    "sync": (MS_SYNCHRONOUS, 0),
    "async": (0, MS_SYNCHRONOUS),
    "dirsync": (MS_DIRSYNC, 0),
    "mand": (MS_MANDLOCK, 0),
    "nomand": (0, MS_MANDLOCK),
    "symfollow": (0, MS_NOSYMFOLLOW),
    "nosymfollow": (MS_NOSYMFOLLOW, 0),
    "atime": (0, MS_NOATIME),
    "noatime": (MS_NOATIME, 0),
    "diratime": (0, MS_NODIRATIME),
    "nodiratime": (MS_NODIRATIME, 0),
    "relatime": (MS_RELATIME, 0),
    "norelatime": (0, MS_RELATIME),
    "strictatime": (MS_STRICTATIME, 0),
    "nostrictatime": (0, MS_STRICTATIME),
    "lazytime": (MS_LAZYTIME, 0),
    "nolazytime": (0, MS_LAZYTIME),
    "silent": (MS_SILENT, 0),
    "loud": (0, MS_SILENT),
    "auto": (0, 0),
    "noauto": (0, 0),
    "user": (0, 0),
    "nouser": (0, 0),
    "users": (0, 0),
    "nofail": (0, 0),
    "_netdev": (0, 0),
}


@dataclass(frozen=True)
class MountOptions:
    flags: int
    data: str  # the filesystem-specific rest, comma-separated, for the filesystem to judge


def parse_options(options: Sequence[str]) -> MountOptions:
    """Splits mount options as mount(8) does: generic ones into MS_* flags (a later option wins
    over an earlier contrary one), the others, in their order, into the filesystem's data."""
    flags, data = 0, []
    for opt in (o.strip() for item in options for o in item.split(",")):
        if not opt:
            continue
        generic = _GENERIC.get(opt)
        if generic is None:
            data.append(opt)
            continue
        flags = (flags | generic[0]) & ~generic[1]
    return MountOptions(flags, ",".join(data))


def _check(rc: int, argv: list[str]) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        # The same kind of error the tools raised, so callers and the gRPC layer treat a failed
        # mount(2) exactly as a failed mount(8); the text is the kernel's errno, with the call.
        raise ToolError(argv, err, f"{os.strerror(err)} (errno {err})")


def mount(source: str, target: str, fs_type: str, options: Sequence[str] = ()) -> None:
    """Blocking (a filesystem's mount reads its device): call it from a thread."""
    opts = parse_options(options)
    rc = _libc.mount(
        source.encode(), target.encode(), fs_type.encode(), opts.flags, opts.data.encode() or None
    )
    argv = ["mount", "-t", fs_type, *(["-o", ",".join(options)] if options else []), source, target]
    _check(rc, argv)


def bind(source: str, target: str) -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), None, MS_BIND, None),
        ["mount", "--bind", source, target],
    )


def remount_bind_read_only(target: str) -> None:
    """Makes a bind mount read-only: a bind always starts with its source's flags."""
    rc = _libc.mount(b"none", target.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
    _check(rc, ["mount", "-o", "remount,bind,ro", target])


# A symlink swapped in for the mount point after the caller checked it is not followed.
UMOUNT_NOFOLLOW = 8


def unmount(target: str) -> None:
    _check(_libc.umount2(target.encode(), UMOUNT_NOFOLLOW), ["umount", target])
