"""Loop devices through losetup: attach a backing file, find what is attached, refresh, detach."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.logs import get_logger

from .tools import run

log = get_logger("csi.loop")

# LOOP_CTL_GET_FREE followed by LOOP_CONFIGURE can race between two attaches in one process; one
# lock keeps `losetup --find` honest without slowing different volumes' mkfs or mounts.
_attach_lock = asyncio.Lock()


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


async def attach(back_file: str, direct_io: bool = True, read_only: bool = False) -> LoopDevice:
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
