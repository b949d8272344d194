"""Filesystems on a block device: detect (blkid), create (mkfs), grow, and report usage."""

from __future__ import annotations

import asyncio
import os
import struct
from dataclasses import dataclass

from controller_runtime.logs import get_logger

from .tools import ToolError, run

log = get_logger("csi.fs")

SUPPORTED = ("ext4", "xfs", "ext3", "ext2")
DEFAULT_FS = "ext4"


@dataclass(frozen=True)
class Signature:
    """What blkid found on a device: a filesystem TYPE, or a partition table PTTYPE, or nothing."""

    fs_type: str = ""
    pt_type: str = ""

    @property
    def blank(self) -> bool:
        return not self.fs_type and not self.pt_type


# The ext2/3/4 superblock, 1024 bytes in: s_blocks_count_lo at 4, s_log_block_size at 24, s_magic
# at 56, s_feature_compat/incompat/ro_compat at 92/96/100, s_blocks_count_hi at 0x150.
_EXT_OFFSET = 1024
_EXT_MAGIC = 0xEF53
_EXT_COMPAT_HAS_JOURNAL = 0x4
_EXT_INCOMPAT_JOURNAL_DEV = 0x8
_EXT_INCOMPAT_64BIT = 0x80
# The features ext3 knows (filetype, recover, meta_bg; sparse_super, large_file, btree_dir): a
# filesystem with any other is ext4, as blkid names it.
_EXT3_INCOMPAT = 0x2 | 0x4 | 0x10
_EXT3_RO_COMPAT = 0x1 | 0x2 | 0x4


@dataclass(frozen=True)
class ExtSuperblock:
    fs_type: str  # ext2, ext3 or ext4
    size: int  # bytes the filesystem spans


def _parse_ext(sb: bytes) -> ExtSuperblock | None:
    if len(sb) < 0x154 or struct.unpack_from("<H", sb, 56)[0] != _EXT_MAGIC:
        return None
    compat, incompat, ro_compat = struct.unpack_from("<3I", sb, 92)
    log_block = struct.unpack_from("<I", sb, 24)[0]
    if incompat & _EXT_INCOMPAT_JOURNAL_DEV or log_block > 6:
        return None  # an external journal, or not a superblock after all: blkid decides
    blocks = struct.unpack_from("<I", sb, 4)[0]
    if incompat & _EXT_INCOMPAT_64BIT:
        blocks |= struct.unpack_from("<I", sb, 0x150)[0] << 32
    if incompat & ~_EXT3_INCOMPAT or ro_compat & ~_EXT3_RO_COMPAT:
        fs_type = "ext4"
    else:
        fs_type = "ext3" if compat & _EXT_COMPAT_HAS_JOURNAL else "ext2"
    return ExtSuperblock(fs_type, blocks * (1024 << log_block))


def _read_head(device: str) -> bytes:
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.pread(fd, _EXT_OFFSET + 1024, 0)
    finally:
        os.close(fd)


def known_signature(head: bytes) -> Signature | None:
    """The filesystems kubeloop makes, recognised from the device's first 2 KiB; None for
    anything else (blank, a partition table, another filesystem), which blkid then judges."""
    if head[:4] == b"XFSB":
        return Signature(fs_type="xfs")
    ext = _parse_ext(head[_EXT_OFFSET:])
    return Signature(fs_type=ext.fs_type) if ext else None


async def probe(device: str) -> Signature:
    # The filesystems kubeloop makes are read from their superblock, without a process; a device
    # that holds none of them goes to blkid, the only judge of "blank" before a mkfs.
    known = known_signature(await asyncio.to_thread(_read_head, device))
    if known is not None:
        return known
    # -p reads the device itself instead of blkid's cache, which may be stale for loop devices.
    result = await run("blkid", "-p", "-o", "export", device, check=False)
    if result.returncode == 2:  # nothing found: a blank device
        return Signature()
    if result.returncode != 0:
        raise ToolError(["blkid", "-p", "-o", "export", device], result.returncode, result.stderr)
    fields = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    return Signature(fs_type=fields.get("TYPE", ""), pt_type=fields.get("PTTYPE", ""))


async def mkfs(device: str, fs_type: str, overwrite: bool = False) -> None:
    """Makes a filesystem on `device`; `overwrite` also over the signature a killed mkfs of the
    caller's own left (mkfs.xfs refuses to write over one without -f; mkfs.ext* forces anyway)."""
    if fs_type not in SUPPORTED:
        # The last guard before a tool named after the type runs: callers check requests first.
        raise ValueError(f"refusing to run mkfs for unsupported filesystem {fs_type!r}")
    if fs_type == "xfs":
        # -K: do not discard; on a fresh sparse file there is nothing to discard.
        argv = ["mkfs.xfs", "-q", "-K", *(["-f"] if overwrite else []), device]
    else:
        # Lazy init leaves inode-table and journal zeroing to the kernel after mount, which keeps
        # mkfs of a large sparse volume under a second; no reserved blocks on a data volume.
        argv = [
            f"mkfs.{fs_type}",
            "-q",
            "-F",
            "-m",
            "0",
            "-E",
            "lazy_itable_init=1,lazy_journal_init=1,nodiscard",
            device,
        ]
    await run(*argv)
    log.info("created filesystem", device=device, fs_type=fs_type)


# resize2fs leaves a tail smaller than a block group unused; below this slack a filesystem counts
# as filling its device, so a stage after an expansion does not fsck and resize again and again.
_GROW_SLACK = 1 << 20


class ResizeNotPermitted(ToolError):
    pass


async def ext_size(device: str) -> int:
    """Size of the ext2/3/4 filesystem on device, from its superblock."""
    ext = _parse_ext((await asyncio.to_thread(_read_head, device))[_EXT_OFFSET:])
    if ext is None:
        raise ToolError(["read ext superblock", device], 1, f"{device} holds no ext2/3/4 superblock")
    return ext.size


async def ext_needs_grow(device: str, device_size: int) -> bool:
    return device_size - await ext_size(device) >= _GROW_SLACK


async def check_before_grow(device: str, after_interrupted_grow: bool) -> None:
    """The forced check resize2fs insists on before an offline grow. A clean answer or errors
    corrected in preen mode pass; anything else needs a human, except after a grow of this very
    filesystem was killed midway: resize2fs then leaves the resize inode and the free-block
    counters wrong (never a file's blocks), which e2fsck -y repairs."""
    check = await run("e2fsck", "-f", "-p", device, check=False)
    if check.returncode >= 2 and after_interrupted_grow:  # 0: clean, 1: errors corrected
        log.warning("repairing a filesystem whose offline grow was interrupted", device=device)
        check = await run("e2fsck", "-f", "-y", device, check=False)
    if check.returncode >= 2:
        raise ToolError(["e2fsck", "-f", "-p", device], check.returncode, check.stderr or check.stdout)


async def resize_offline(device: str) -> None:
    """Grows an unmounted, freshly checked ext filesystem to fill its device."""
    await run("resize2fs", device)
    log.info("grew filesystem offline", device=device)


async def grow(device: str, fs_type: str, mountpoint: str) -> None:
    """Grows a mounted filesystem to fill its (already enlarged) device."""
    if fs_type == "xfs":
        await run("xfs_growfs", "-d", mountpoint)
    elif fs_type.startswith("ext"):
        try:
            await run("resize2fs", device)
        except ToolError as e:
            if "Permission denied" in e.stderr:
                # EXT4_IOC_RESIZE_FS needs CAP_SYS_RESOURCE, which some containers drop.
                raise ResizeNotPermitted(
                    e.argv,
                    e.returncode,
                    e.stderr + " (online ext4 resize needs "
                    "CAP_SYS_RESOURCE; grant it to the node plugin, or unstage the "
                    "volume: NodeStageVolume grows it offline)",
                ) from e
            raise
    else:
        raise ToolError(["grow"], 1, f"cannot grow a {fs_type} filesystem")
    log.info("grew filesystem", device=device, fs_type=fs_type)


@dataclass(frozen=True)
class Usage:
    total_bytes: int
    available_bytes: int
    used_bytes: int
    total_inodes: int
    available_inodes: int
    used_inodes: int


async def usage(path: str) -> Usage:
    st = await asyncio.to_thread(os.statvfs, path)
    total = st.f_blocks * st.f_frsize
    free = st.f_bfree * st.f_frsize
    return Usage(
        total_bytes=total,
        available_bytes=st.f_bavail * st.f_frsize,
        used_bytes=total - free,
        total_inodes=st.f_files,
        available_inodes=st.f_favail,
        used_inodes=st.f_files - st.f_ffree,
    )
