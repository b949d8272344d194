"""What a stack may leave on the machine once its processes are gone: mounts under its home and
loop devices whose backing file is in it. The launcher checks after a stop (the node agents unmount
their volumes on the way down; this says when one could not), the tests assert there is none."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from controller_runtime.mounts import read_mounts


@dataclass(frozen=True)
class Leftovers:
    mounts: list[str]
    loop_devices: list[tuple[str, str]]  # (device, backing file)

    def __bool__(self) -> bool:
        return bool(self.mounts or self.loop_devices)


def mounts_under(root: Path) -> list[str]:
    points = [m.mountpoint for m in read_mounts()]
    return [p for p in points if p.startswith(str(root) + "/")]


def loop_backing_files() -> list[tuple[str, str]]:
    """(device, backing file) of every loop device on the machine. A backing file deleted since
    shows as its old path with " (deleted)" after it."""
    out = subprocess.run(
        ["losetup", "--list", "--json", "--output", "NAME,BACK-FILE"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    devices = json.loads(out)["loopdevices"] if out.strip() else []
    return [(str(d["name"]), str(d.get("back-file") or "")) for d in devices]


def loop_devices_under(root: Path) -> list[tuple[str, str]]:
    return [(dev, back) for dev, back in loop_backing_files() if back.startswith(str(root) + "/")]


def find_leftovers(root: Path) -> Leftovers:
    return Leftovers(mounts_under(root), loop_devices_under(root))


def force_cleanup(root: Path) -> None:
    """Whatever a failed test left: unmount under root, detach loop devices of its pool. For tests:
    a stack cleans up after itself through its node agents."""
    for point in sorted(mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False)
    for dev, _back in loop_devices_under(root):
        subprocess.run(["losetup", "-d", dev], check=False)
