"""The mount table: /proc/self/mountinfo parsed, and whether a path is a mount point. Read by the
node agent (what is still mounted after a restart or an unpublish) and by the CSI driver's node
service; mounting and unmounting belong to the driver (csi_driver/backend/mounts.py)."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

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
    return bool(mounts_at(path, table))
