"""Mount, bind-mount and unmount. Reading the mount table is controller_runtime.mounts.

Targets and sources from requests arrive as `/proc/self/fd/<fd>[/<name>]` paths on descriptors the
caller opened without following symlinks (csi_driver.paths); mount(8) inherits those descriptors and
gets `--no-canonicalize`, so it never resolves a symlink of its own either.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from controller_runtime.logs import get_logger
from controller_runtime.mounts import is_mounted

from .tools import run

log = get_logger("csi.mounts")


def device_number(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


async def mount(
    source: str,
    target: str,
    fs_type: str,
    options: Sequence[str] = (),
    *,
    name: str = "",
    pass_fds: tuple[int, ...] = (),
) -> None:
    argv = ["mount", "--no-canonicalize", "-t", fs_type]
    if options:
        argv += ["-o", ",".join(options)]
    await run(*argv, source, target, pass_fds=pass_fds)
    log.info("mounted", source=source, target=name or target, fs_type=fs_type, options=",".join(options))


async def bind(
    source: str,
    target: str,
    *,
    remount_target: str = "",
    read_only: bool = False,
    name: str = "",
    pass_fds: tuple[int, ...] = (),
) -> None:
    """Bind-mounts source onto target; read-only with a second call on `remount_target` (the
    target as reached through its parent, since `target` may name the directory underneath)."""
    await run("mount", "--no-canonicalize", "--bind", source, target, pass_fds=pass_fds)
    if read_only:
        await run("mount", "--no-canonicalize", "-o", "remount,bind,ro", remount_target, pass_fds=pass_fds)
    log.info("bind-mounted", source=source, target=name or target, read_only=read_only)


async def unmount(path: str, target: str, *, pass_fds: tuple[int, ...] = ()) -> None:
    """Unmounts every mount stacked on `path` (a retried mount may have stacked two); `target` is
    how umount reaches it."""
    while is_mounted(path):
        await run("umount", "--no-canonicalize", target, pass_fds=pass_fds)
        log.info("unmounted", target=path)
