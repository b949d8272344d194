"""Snapshots of host directories a test must not change: every entry under a directory, never
following a symlink, with its type, mode, size, content digest and link target."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

Entry = tuple[str, int, int, str]


def _entry(path: str, dir_mtime: bool = True) -> Entry | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:  # e.g. a name too long to exist: nothing there to change
        return ("error", 0, 0, str(e.errno))
    detail = ""
    if stat.S_ISLNK(st.st_mode):
        detail = os.readlink(path)
    elif stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            detail = hashlib.sha256(f.read()).hexdigest()
    is_dir = stat.S_ISDIR(st.st_mode)
    # A directory's mtime moves when anything is created or deleted in it, even briefly.
    mtime = st.st_mtime_ns if dir_mtime or not is_dir else 0
    return (stat.filemode(st.st_mode), 0 if is_dir else st.st_size, mtime, detail)


def snapshot_tree(root: Path) -> dict[str, Entry | None]:
    """Every entry under root (included), by path relative to root."""
    tree: dict[str, Entry | None] = {".": _entry(str(root))}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            tree[os.path.relpath(full, root)] = _entry(full)
    return tree


def snapshot_paths(paths: set[str]) -> dict[str, Entry | None]:
    """The named host paths themselves (absent ones as None), without descending; directories
    without their mtime (other processes on the host create files in /tmp and the like)."""
    return {p: _entry(p, dir_mtime=False) for p in sorted(paths)}


def mounted_under(root: Path) -> list[str]:
    from controller_runtime.mounts import read_mounts

    prefix = str(root).rstrip("/") + "/"
    return [m.mountpoint for m in read_mounts() if (m.mountpoint + "/").startswith(prefix)]
