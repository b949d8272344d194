"""Loop devices through losetup: attach a backing file, find what is attached, refresh, detach."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.logs import get_logger

from .tools import ToolError, run

log = get_logger("csi.loop")

# LOOP_CTL_GET_FREE followed by LOOP_CONFIGURE can race between two attaches in one process; one
# lock keeps `losetup --find` honest without slowing different volumes' mkfs or mounts.
_attach_lock = asyncio.Lock()

LOOP_CTL_GET_FREE = 0x4C82  # linux/loop.h: the lowest free loop device, created when none is


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
        kernel adds later has no node there (no devtmpfs, no udev), and losetup fails on it."""
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

    def ensure_free_node(self) -> bool:
        """Gives the device `losetup --find` will take a node, asking the kernel which it is
        (LOOP_CTL_GET_FREE, which adds a device when none is free); says whether it made one.
        Without /dev/loop-control losetup scans the nodes itself and there is nothing to do; a
        failure here is only logged, losetup then reports what is wrong."""
        control = self.dev / "loop-control"
        try:
            fd = os.open(control, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as e:
            log.warning("cannot open the loop control device", path=str(control), error=str(e))
            return False
        try:
            index = fcntl.ioctl(fd, LOOP_CTL_GET_FREE)
            return self.ensure_node(index)
        except (OSError, ValueError) as e:
            log.warning("cannot prepare a free loop device node", error=str(e))
            return False
        finally:
            os.close(fd)


@dataclass(frozen=True)
class LoopDevice:
    name: str  # /dev/loopN
    back_file: str
    direct_io: bool
    read_only: bool
    # The backing file's filesystem ("major:minor") and inode, as the kernel recorded them at attach.
    back_dev: str = ""
    back_ino: int = 0

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


async def list_devices() -> list[LoopDevice]:
    """Every configured loop device on the machine, as the kernel reports it."""
    result = await run(
        "losetup", "--list", "--json", "--output", "NAME,BACK-FILE,BACK-MAJ:MIN,BACK-INO,DIO,RO"
    )
    if not result.stdout.strip():
        return []
    doc = json.loads(result.stdout)
    devices = []
    for entry in doc.get("loopdevices", []):
        devices.append(
            LoopDevice(
                name=str(entry["name"]),
                back_file=_back_file(str(entry.get("back-file") or "")),
                direct_io=entry.get("dio") in (True, "1", 1),
                read_only=entry.get("ro") in (True, "1", 1),
                back_dev=str(entry.get("back-maj:min") or "").strip(),
                back_ino=int(entry.get("back-ino") or 0),
            )
        )
    return devices


async def devices_for(back_file: str) -> list[LoopDevice]:
    return [d for d in await list_devices() if d.backed_by(back_file)]


async def attach(
    back_file: str, direct_io: bool = True, read_only: bool = False, nodes: DeviceNodes = DeviceNodes()
) -> LoopDevice:
    """Attaches a file to a free loop device.

    Direct I/O skips the page cache of the pool's filesystem, so data is cached once (in the
    filesystem on the loop device) instead of twice. When the backing filesystem cannot do it
    (tmpfs, some overlays) losetup still attaches and the kernel falls back to buffered I/O.
    """
    argv = ["losetup", "--find", "--show"]
    if direct_io:
        argv.append("--direct-io=on")
    if read_only:
        argv.append("--read-only")
    async with _attach_lock:
        nodes.ensure_free_node()
        try:
            result = await run(*argv, back_file)
        except ToolError:
            # Other users of the kernel (node plugins of other kind nodes share it) may have taken
            # the device prepared above, and losetup found the next one without a node: once more
            # when that is what happened.
            if not nodes.ensure_free_node():
                raise
            result = await run(*argv, back_file)
    name = result.stdout.strip().splitlines()[-1]
    dio = _direct_io(name)
    log.info("attached loop device", device=name, file=back_file, direct_io=dio)
    return LoopDevice(name=name, back_file=back_file, direct_io=dio, read_only=read_only)


def _direct_io(device: str) -> bool:
    """Whether the kernel actually uses direct I/O for the device (sysfs reads never block)."""
    try:
        return Path(f"/sys/block/{Path(device).name}/loop/dio").read_text().strip() == "1"
    except OSError:
        return False


async def detach(device: str) -> None:
    await run("losetup", "--detach", device)
    log.info("detached loop device", device=device)


async def refresh_capacity(device: str) -> None:
    """Makes the kernel re-read the backing file's size after it grew (`losetup -c`)."""
    await run("losetup", "--set-capacity", device)


def device_size(device: str) -> int:
    """Size in bytes from sysfs (in 512-byte sectors, whatever the logical block size)."""
    return int(Path(f"/sys/block/{Path(device).name}/size").read_text()) * 512
