"""Mounts: read /proc/self/mountinfo, mount, bind-mount and unmount."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from controller_runtime.logs import get_logger

from .tools import run

log = get_logger("csi.mounts")

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


def mounts_at(path: str, table: Sequence[Mount] | None = None) -> list[Mount]:
    path = os.path.normpath(path)
    return [m for m in (read_mounts() if table is None else table) if m.mountpoint == path]


def is_mounted(path: str, table: Sequence[Mount] | None = None) -> bool:
    return bool(mounts_at(path, table))


def device_number(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


async def mount(source: str, target: str, fs_type: str, options: Sequence[str] = ()) -> None:
    argv = ["mount", "-t", fs_type]
    if options:
        argv += ["-o", ",".join(options)]
    await run(*argv, source, target)
    log.info("mounted", source=source, target=target, fs_type=fs_type, options=",".join(options))


async def bind(source: str, target: str, read_only: bool) -> None:
    # util-linux applies `ro` to a bind mount with a second (remount) call itself.
    await run("mount", "--bind", *(["-o", "ro"] if read_only else []), source, target)
    log.info("bind-mounted", source=source, target=target, read_only=read_only)


async def unmount(target: str) -> None:
    """Unmounts every mount stacked on target (a retried mount may have stacked two)."""
    while is_mounted(target):
        await run("umount", target)
        log.info("unmounted", target=target)
