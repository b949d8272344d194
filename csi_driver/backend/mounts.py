"""Mount, bind-mount and unmount. Reading the mount table is controller_runtime.mounts."""

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
