"""Files that more than one process may touch: atomic replacement, directory ownership.

Every temporary name carries the writer's pid and a random token, so two processes writing the
same target at the same instant never open, rename or delete each other's temporary file; the
last rename wins whole. Leftovers of a killed writer are removed only by the process that holds
the directory's `FileLock`, the only one allowed to assume no other writer is live.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from .clock import SYSTEM_CLOCK, Clock

_TEMP_SUFFIX = ".tmp"


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Writes all of `data`: os.write may take less than it is given."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def temp_name(target: str | Path) -> str:
    """A hidden sibling of `target` that no other process (or thread) will pick."""
    head, tail = os.path.split(os.fspath(target))
    return os.path.join(head, f".{tail}.{os.getpid()}-{secrets.token_hex(4)}{_TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(_TEMP_SUFFIX)


def write_atomic(
    path: str | Path,
    data: bytes,
    *,
    durable: bool = True,
    mode: int = 0o600,
    sync_dir: bool = True,
) -> None:
    """Replaces `path` with `data`: a crash leaves the old content or the new, never a torn file.

    The file is created with `mode` (never briefly more open). `durable=False` skips the fsyncs,
    for content whose loss on power failure is harmless. `sync_dir=False` leaves the directory's
    fsync (which makes the rename durable) to a caller that writes several files in it and syncs
    it once for all of them.
    """
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable and sync_dir:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def remove_stale_temps(directory: str | Path) -> list[str]:
    """Removes temporary files left in `directory` by killed writers. Call it only while holding
    the directory's `FileLock`: a live writer's file would go too."""
    removed = []
    with contextlib.suppress(FileNotFoundError), os.scandir(directory) as entries:
        for entry in entries:
            if is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


class FileLock:
    """An exclusive flock on one file, held until `release` (or the holder's death, however it
    dies: the kernel drops the lock with the last descriptor).

    Guards a directory that one process must own at a time: a driver's state directory, the
    pool's controller side. The lock file is never renamed or deleted (two processes would then
    lock two different inodes); it holds the holder's pid, for the message of whoever waits.
    """

    def __init__(self, path: str | Path, clock: Clock = SYSTEM_CLOCK) -> None:
        self.path = Path(path)
        self.clock = clock  # what `acquire` waits on between tries
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return True

    async def acquire(self, on_wait: Callable[[str], None], poll: float = 0.5) -> None:
        """Waits for the lock; `on_wait` hears once who holds it (a process still shutting down
        during a restart, or a second process configured on the same directory)."""
        told = False
        while not await asyncio.to_thread(self.try_acquire):
            if not told:
                on_wait(f"{self.path} is held by another process{self._holder()}")
                told = True
            await self.clock.sleep(poll)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _holder(self) -> str:
        try:
            pid = self.path.read_text().strip()
        except OSError:
            return ""
        return f" (pid {pid})" if pid.isdigit() else ""
