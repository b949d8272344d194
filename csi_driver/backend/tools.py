"""Runs the system tools (losetup, mkfs, mount, ...) as asyncio subprocesses."""

from __future__ import annotations

import asyncio
import os
import weakref
from dataclasses import dataclass

from controller_runtime.logs import get_logger

log = get_logger("csi.tools")

# The tools live in /sbin on Debian; a process started from a user shell may not have it in PATH.
_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


# At most this many tools run at once in one driver process; the others queue. A pod with hundreds
# of volumes (the e2e volumeLimits spec: 256) makes kubelet stage them all at once, and hundreds of
# mkfs and mount processes on a few cores, each spawned by a fork on the event loop, starved the
# loop until Probe missed the liveness probe's deadline for 25 s and kubelet killed the plugin in
# the middle of its operations. Queued, the volumes are staged as fast and Probe answers at once.
MAX_PARALLEL_TOOLS = max(8, 4 * (os.cpu_count() or 1))
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def _slot() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slot = _slots.get(loop)
    if slot is None:
        slot = _slots[loop] = asyncio.Semaphore(MAX_PARALLEL_TOOLS)
    return slot


class ToolError(RuntimeError):
    """A tool exited non-zero; the message carries its stderr, which is what an operator needs."""

    def __init__(self, argv: list[str], returncode: int, stderr: str) -> None:
        self.argv = argv
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"{' '.join(argv)} failed (exit {returncode}): {self.stderr or 'no output'}")


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


async def run(
    *argv: str, check: bool = True, timeout: float = 300.0, pass_fds: tuple[int, ...] = ()
) -> Result:
    """Runs argv (never through a shell) and returns its output. `pass_fds` are inherited by the
    child under the same numbers (for `/proc/self/fd/<fd>` paths).

    The child is not killed when the calling task is cancelled: an interrupted mkfs or mount would
    leave a worse state than a finished one, so cancellation waits for the tool to exit. The
    timeout counts from the tool's start, not from the wait for a slot (MAX_PARALLEL_TOOLS).
    """
    async with _slot():
        return await _run(argv, check, timeout, pass_fds)


async def _run(argv: tuple[str, ...], check: bool, timeout: float, pass_fds: tuple[int, ...]) -> Result:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PATH": _PATH, "LC_ALL": "C"},
        pass_fds=pass_fds,
    )
    communicate = asyncio.ensure_future(proc.communicate())
    try:
        out, err = await asyncio.wait_for(asyncio.shield(communicate), timeout)
    except TimeoutError:
        proc.kill()
        await communicate
        raise ToolError(list(argv), -9, f"timed out after {timeout:.0f}s") from None
    except asyncio.CancelledError:
        await communicate
        raise
    result = Result(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))
    log.debug("ran tool", argv=" ".join(argv), rc=result.returncode)
    if check and result.returncode != 0:
        raise ToolError(list(argv), result.returncode, result.stderr or result.stdout)
    return result
