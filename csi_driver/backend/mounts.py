"""Mount, bind-mount and unmount. Reading the mount table is controller_runtime.mounts.

Targets and sources from requests arrive as `/proc/self/fd/<fd>[/<name>]` paths on descriptors the
caller opened without following symlinks (csi_driver.paths); the kernel resolves those itself, so
no symlink is ever followed. The calls go straight to the kernel (syscalls.py) from a worker
thread: a filesystem's mount reads its device, and the event loop must not wait for that.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

from controller_runtime.logs import get_logger
from controller_runtime.mounts import is_mounted

from . import syscalls

log = get_logger("csi.mounts")


def device_number(device: str) -> str:
    st = os.stat(device)
    return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


async def mount(
    source: str, target: str, fs_type: str, options: Sequence[str] = (), *, name: str = ""
) -> None:
    await asyncio.to_thread(syscalls.mount, source, target, fs_type, options)
    log.info("mounted", source=source, target=name or target, fs_type=fs_type, options=",".join(options))


async def bind(
    source: str, target: str, *, remount_target: str = "", read_only: bool = False, name: str = ""
) -> None:
    """Bind-mounts source onto target; read-only with a second call on `remount_target` (the
    target as reached through its parent, since `target` may name the directory underneath)."""

    def _bind() -> None:
        syscalls.bind(source, target)
        if read_only:
            syscalls.remount_bind_read_only(remount_target)

    await asyncio.to_thread(_bind)
    log.info("bind-mounted", source=source, target=name or target, read_only=read_only)


async def unmount(path: str, target: str) -> None:
    """Unmounts every mount stacked on `path` (a retried mount may have stacked two); `target` is
    how the kernel reaches it."""
    while is_mounted(path):
        await asyncio.to_thread(syscalls.unmount, target)
        log.info("unmounted", target=path)
