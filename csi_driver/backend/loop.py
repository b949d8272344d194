"""Loop devices through the kernel's loop ioctls: attach a backing file (LOOP_CONFIGURE), find
what is attached (sysfs, LOOP_GET_STATUS64), refresh the size, detach (LOOP_CLR_FD).

These used to be `losetup` runs, a fork and an exec per call; ioctls on the devices are the same
calls losetup makes, without the process. LOOP_CONFIGURE needs Linux 5.8 or later.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.logs import get_logger

from .files import UnsafePoolFile, open_regular
from .tools import ToolError

log = get_logger("csi.loop")

# LOOP_CTL_GET_FREE then LOOP_CONFIGURE is not atomic: within this process the lock keeps two
# attaches from picking the same device; another process racing for it makes LOOP_CONFIGURE fail
# with EBUSY, and the attach asks for the next free device.
_attach_lock = asyncio.Lock()
_ATTACH_TRIES = 16

# linux/loop.h
LOOP_CLR_FD = 0x4C01
LOOP_GET_STATUS64 = 0x4C05
LOOP_SET_CAPACITY = 0x4C07
LOOP_CONFIGURE = 0x4C0A
LOOP_CTL_GET_FREE = 0x4C82  # the lowest free loop device, created when none is
LO_FLAGS_READ_ONLY = 1
LO_FLAGS_DIRECT_IO = 16
# struct loop_info64: lo_device, lo_inode, lo_rdevice, lo_offset, lo_sizelimit; lo_number,
# lo_encrypt_type, lo_encrypt_key_size, lo_flags; lo_file_name, lo_crypt_name, lo_encrypt_key;
# lo_init[2]. struct loop_config: fd, block_size, info, reserved[8].
_INFO64 = struct.Struct("=5Q4I64s64s32s2Q")
# The owner mark also goes into lo_file_name, behind this prefix: kernels since cryptoloop's removal
# (5.19) no longer keep lo_crypt_name, while lo_file_name is kept and returned as given. Nothing
# reads the path from there (sysfs backing_file, which losetup lists, is the kernel's own).
_OWNER_IN_FILE_NAME = "kubeloop-owner="
_CONFIG = struct.Struct(f"=2I{_INFO64.size}s8Q")


@dataclass(frozen=True)
class DeviceNodes:
    """Where the loop device nodes live and where the kernel says which numbers they have; tests
    stand temporary directories in for /dev and /sys/block."""

    dev: Path = Path("/dev")
    sys_block: Path = Path("/sys/block")

    def ensure_node(self, index: int) -> bool:
        """Makes <dev>/loopN, a block node 0660 with the numbers in <sys_block>/loopN/dev, unless
        it exists; says whether it made it.

        In a container /dev is a tmpfs filled when the container started: a loop device the
        kernel adds later has no node there (no devtmpfs, no udev) to open."""
        path = self.dev / f"loop{index}"
        if os.path.lexists(path):
            return False
        major, minor = (self.sys_block / f"loop{index}" / "dev").read_text().strip().split(":")
        try:
            os.mknod(path, stat.S_IFBLK | 0o660, os.makedev(int(major), int(minor)))
        except FileExistsError:  # udev or another plugin sharing this /dev was quicker
            return False
        os.chmod(path, 0o660)  # as udev makes them; mknod's mode went through the umask
        log.info("created loop device node", device=str(path), numbers=f"{major}:{minor}")
        return True

    def free_index(self) -> int:
        """The number of the lowest free loop device, as the kernel tells it (LOOP_CTL_GET_FREE
        adds a device when none is free); its node is made when this /dev lacks it."""
        fd = os.open(self.dev / "loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            index = fcntl.ioctl(fd, LOOP_CTL_GET_FREE)
        finally:
            os.close(fd)
        self.ensure_node(index)
        return index

    def open(self, name: str, flags: int = os.O_RDONLY, *, make: bool = True) -> int:
        """Opens loopN (or /dev/loopN) through this /dev, making its node first when a
        container's /dev lacks it, unless `make` is false."""
        path = self.dev / Path(name).name
        if make and not os.path.lexists(path):
            self.ensure_node(int(Path(name).name.removeprefix("loop")))
        return os.open(path, flags | os.O_CLOEXEC)


@dataclass(frozen=True)
class LoopDevice:
    name: str  # /dev/loopN
    back_file: str
    direct_io: bool
    read_only: bool
    # The backing file's filesystem ("major:minor") and inode, as the kernel recorded them at attach.
    back_dev: str = ""
    back_ino: int = 0
    # Who attached it and for what, as the attach wrote it into lo_crypt_name (unused without
    # encryption, and returned by LOOP_GET_STATUS64): "" for devices attached by anyone else.
    owner: str = ""

    def backed_by(self, path: str) -> bool:
        """Whether `path` is this device's backing file. By path first; else by device and inode,
        since the kernel prints the path from the reader's mount namespace: a device attached by a
        node plugin whose container was restarted shows a path relative to a mount the new one
        cannot see (`/volumes/x.img` instead of `/var/lib/kubeloop/pool/volumes/x.img`)."""
        if self.back_file == path:
            return True
        if not self.back_ino:
            return False
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (self.back_dev, self.back_ino) == (f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", st.st_ino)


def _back_file(raw: str) -> str:
    # The kernel appends " (deleted)" when the backing file was unlinked while attached.
    return raw.removesuffix(" (deleted)")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _owner_of(file_name: bytes, crypt_name: bytes) -> str:
    """The owner mark of a device's status: lo_crypt_name where the kernel keeps it, else what
    follows the prefix in lo_file_name."""
    crypt = crypt_name.rstrip(b"\0").decode("utf-8", "replace")
    named = file_name.rstrip(b"\0").decode("utf-8", "replace")
    return crypt or (named[len(_OWNER_IN_FILE_NAME) :] if named.startswith(_OWNER_IN_FILE_NAME) else "")


def _device(name: str, nodes: DeviceNodes) -> LoopDevice | None:
    """What sysfs and the device say of loopN; None when it has no backing file."""
    loop_dir = nodes.sys_block / name / "loop"
    back_file = _read(loop_dir / "backing_file")
    if not back_file:
        return None
    back_dev, back_ino, owner = "", 0, ""
    try:
        fd = nodes.open(name, make=False)  # listing makes no node; a missing one leaves the path
        try:
            info = _INFO64.unpack(fcntl.ioctl(fd, LOOP_GET_STATUS64, bytes(_INFO64.size)))
        finally:
            os.close(fd)
        back_dev, back_ino = f"{os.major(info[0])}:{os.minor(info[0])}", int(info[1])
        owner = _owner_of(info[9], info[10])
    except OSError:
        pass  # detached meanwhile, or a node that cannot be made: the path has to do
    return LoopDevice(
        name=f"/dev/{name}",
        back_file=_back_file(back_file),
        direct_io=_read(loop_dir / "dio") == "1",
        read_only=_read(nodes.sys_block / name / "ro") == "1",
        back_dev=back_dev,
        back_ino=back_ino,
        owner=owner,
    )


def _list(nodes: DeviceNodes) -> list[LoopDevice]:
    try:
        names = sorted(n for n in os.listdir(nodes.sys_block) if n.startswith("loop"))
    except FileNotFoundError:
        return []
    return [d for d in (_device(n, nodes) for n in names) if d is not None]


async def list_devices(nodes: DeviceNodes = DeviceNodes()) -> list[LoopDevice]:
    """Every configured loop device on the machine, as the kernel reports it."""
    return await asyncio.to_thread(_list, nodes)


async def devices_for(back_file: str, nodes: DeviceNodes = DeviceNodes()) -> list[LoopDevice]:
    return [d for d in await list_devices(nodes) if d.backed_by(back_file)]


async def is_attached(device: str, back_file: str, nodes: DeviceNodes = DeviceNodes()) -> bool:
    """Whether `device` (/dev/loopN) is attached to `back_file`: one device asked, not all."""

    def _ask() -> bool:
        name = Path(device).name
        if _back_file(_read(nodes.sys_block / name / "loop" / "backing_file")) == back_file:
            return True
        found = _device(name, nodes)  # the inode, for a path from another mount namespace
        return found is not None and found.backed_by(back_file)

    return bool(device) and await asyncio.to_thread(_ask)


def _configure(back_file: str, direct_io: bool, read_only: bool, owner: str, nodes: DeviceNodes) -> str:
    try:
        return _configure_once(back_file, direct_io, read_only, owner, nodes)
    except OSError as e:
        if not direct_io or e.errno != errno.EINVAL:
            raise
        # A backing filesystem without direct I/O (tmpfs, some overlays): buffered, as losetup
        # falls back; whether the kernel took direct I/O is read back from sysfs either way.
        return _configure_once(back_file, False, read_only, owner, nodes)


def _configure_once(back_file: str, direct_io: bool, read_only: bool, owner: str, nodes: DeviceNodes) -> str:
    flags = os.O_RDONLY if read_only else os.O_RDWR
    # Never through a symlink, never anything but a regular file (files.open_regular says why).
    backing = open_regular(back_file, flags | (os.O_DIRECT if direct_io else 0))
    lo_flags = (LO_FLAGS_READ_ONLY if read_only else 0) | (LO_FLAGS_DIRECT_IO if direct_io else 0)
    name = (_OWNER_IN_FILE_NAME + owner).encode()[:63] if owner else os.fsencode(back_file)[:63]
    info = _INFO64.pack(0, 0, 0, 0, 0, 0, 0, 0, lo_flags, name, owner.encode()[:63], b"", 0, 0)
    try:
        for _ in range(_ATTACH_TRIES):
            index = nodes.free_index()
            dev = nodes.open(f"loop{index}", flags)
            try:
                fcntl.ioctl(dev, LOOP_CONFIGURE, _CONFIG.pack(backing, 0, info, *([0] * 8)))
                return f"/dev/loop{index}"
            except OSError as e:
                if e.errno != errno.EBUSY:  # taken by another user of the kernel since GET_FREE
                    raise
            finally:
                os.close(dev)
        raise OSError(errno.EBUSY, f"every free loop device was taken first, {_ATTACH_TRIES} times")
    finally:
        os.close(backing)


async def attach(
    back_file: str,
    direct_io: bool = True,
    read_only: bool = False,
    owner: str = "",
    nodes: DeviceNodes = DeviceNodes(),
) -> LoopDevice:
    """Attaches a file to a free loop device, marked with `owner` (at most 63 bytes) so that
    whoever attached it can tell it from another user's device of the same file.

    Direct I/O skips the page cache of the pool's filesystem, so data is cached once (in the
    filesystem on the loop device) instead of twice. When the backing filesystem cannot do it
    (tmpfs, some overlays) the device is still attached and the kernel uses buffered I/O.
    """
    async with _attach_lock:
        try:
            name = await asyncio.to_thread(_configure, back_file, direct_io, read_only, owner, nodes)
        except UnsafePoolFile:
            raise  # the caller's answer is FAILED_PRECONDITION, not a tool failure
        except OSError as e:
            raise ToolError(["attach loop device", back_file], e.errno or 1, str(e)) from e
    dio = _direct_io(name)
    log.info("attached loop device", device=name, file=back_file, direct_io=dio, owner=owner)
    return LoopDevice(name=name, back_file=back_file, direct_io=dio, read_only=read_only, owner=owner)


def _direct_io(device: str) -> bool:
    """Whether the kernel actually uses direct I/O for the device (sysfs reads never block)."""
    try:
        return Path(f"/sys/block/{Path(device).name}/loop/dio").read_text().strip() == "1"
    except OSError:
        return False


async def _loop_ioctl(device: str, request: int, what: str, nodes: DeviceNodes) -> None:
    def _call() -> None:
        fd = nodes.open(device)
        try:
            fcntl.ioctl(fd, request)
        finally:
            os.close(fd)

    try:
        await asyncio.to_thread(_call)
    except OSError as e:
        raise ToolError([what, device], e.errno or 1, str(e)) from e


async def detach(device: str, nodes: DeviceNodes = DeviceNodes()) -> None:
    await _loop_ioctl(device, LOOP_CLR_FD, "detach loop device", nodes)
    log.info("detached loop device", device=device)


async def refresh_capacity(device: str, nodes: DeviceNodes = DeviceNodes()) -> None:
    """Makes the kernel re-read the backing file's size after it grew (`losetup -c`)."""
    await _loop_ioctl(device, LOOP_SET_CAPACITY, "refresh loop device capacity", nodes)


def device_size(device: str) -> int:
    """Size in bytes from sysfs (in 512-byte sectors, whatever the logical block size)."""
    return int(Path(f"/sys/block/{Path(device).name}/size").read_text()) * 512
