"""Host paths from requests, confined to the kubelet directory and resolved without following
symlinks.

A node plugin runs privileged: a staging or target path from a request is a path on the host. Every
such path must lie strictly under the kubelet directory (`--kubelet-dir`, resolved once at start),
and is walked component by component from that directory with
`openat(parent, name, O_PATH | O_NOFOLLOW | O_DIRECTORY)`, so no symlink is ever followed: a
symlink (or a non-directory) anywhere on the way is INVALID_ARGUMENT. Missing directories are made
with `mkdirat`, files with `O_CREAT | O_EXCL | O_NOFOLLOW`. Mount and unmount then name the path
through the descriptors the walk opened (`/proc/self/fd/<fd>` handed to mount(8) with
`--no-canonicalize`), so nothing swapped in between the check and the use can redirect them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import CsiError, invalid
from .validation import check_abs_path

PATH_MAX = 4095
NAME_MAX = 255
_DIR_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
DIR_MODE = 0o750
FILE_MODE = 0o600


def fd_path(fd: int, name: str = "") -> str:
    """The path of an open descriptor of this process (or of `name` inside it), for mount(2)."""
    return f"/proc/self/fd/{fd}" + (f"/{name}" if name else "")


@dataclass
class Walked:
    """The parent directory of a request path, open, and the last component's name. Close it."""

    path: str  # canonical: no symlink, no `.`/`..`, strictly under the kubelet directory
    parent_fd: int
    name: str
    fds: list[int] = field(default_factory=list)  # extra descriptors opened on the final component

    def close(self) -> None:
        for fd in [*self.fds, self.parent_fd]:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()

    def kind(self) -> int | None:
        """st_mode of the last component (never following it), or None when it does not exist."""
        try:
            return os.stat(self.name, dir_fd=self.parent_fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None

    def open_final(self, directory: bool) -> int:
        """An O_PATH descriptor on the last component (a directory, or any non-symlink file);
        INVALID_ARGUMENT for a symlink or the wrong kind."""
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_DIRECTORY if directory else 0)
        try:
            fd = os.open(self.name, flags, dir_fd=self.parent_fd)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise _refused(self.path, e) from e
        if stat.S_ISLNK(os.fstat(fd).st_mode):
            os.close(fd)
            raise invalid(f"{self.path} is a symbolic link; the driver never follows links")
        self.fds.append(fd)
        return fd

    @property
    def via_parent(self) -> str:
        """The path as this process reaches it through `parent_fd` (for umount/remount:
        a mount point cannot be renamed or replaced while mounted)."""
        return fd_path(self.parent_fd, self.name)


def _refused(path: str, e: OSError) -> CsiError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return invalid(f"{path} passes through a symbolic link or a non-directory; refused")
    if e.errno == errno.ENAMETOOLONG:
        return invalid(f"{path[:200]!r} is too long")
    raise e


class KubeletDir:
    """The one directory request paths may name. `root` is resolved once, here."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.realpath(os.fspath(root))
        if not os.path.isdir(self.root):
            raise ValueError(f"kubelet directory {self.root} is not a directory")

    def check(self, value: str, what: str) -> str:
        """Pure checks: absolute, normalised, no NUL, not too long, strictly under the root."""
        path = check_abs_path(value, what)
        if len(path.encode(errors="surrogateescape")) > PATH_MAX:
            raise invalid(f"{what} is longer than {PATH_MAX} bytes")
        if any(len(p.encode(errors="surrogateescape")) > NAME_MAX for p in path.split("/")):
            raise invalid(f"{what} has a component longer than {NAME_MAX} bytes")
        if not path.startswith(self.root.rstrip("/") + "/"):
            raise invalid(
                f"{what} {value[:200]!r} is not under the kubelet directory {self.root} (--kubelet-dir)"
            )
        return path

    def walk(self, value: str, what: str, create_parents: bool = False) -> Walked:
        """Opens the parent of a checked path, never following a symlink; missing parent
        directories are created (0750) when `create_parents`, else FileNotFoundError."""
        path = self.check(value, what)
        parts = path[len(self.root.rstrip("/")) + 1 :].split("/")
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            for name in parts[:-1]:
                try:
                    nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create_parents:
                        raise
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(name, DIR_MODE, dir_fd=fd)
                    try:
                        nxt = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError as e:
                        raise _refused(path, e) from e
                except OSError as e:
                    raise _refused(path, e) from e
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return Walked(path, fd, parts[-1])

    @contextlib.contextmanager
    def walked(self, value: str, what: str, create_parents: bool = False) -> Iterator[Walked]:
        w = self.walk(value, what, create_parents)
        try:
            yield w
        finally:
            w.close()

    # --- operations (blocking; callers run them in a thread) ---------------------------------
    def make_dir(self, value: str, what: str) -> bool:
        """Makes sure `value` is a directory (creating missing parents); True when this call
        created the last component."""
        with self.walked(value, what, create_parents=True) as w:
            try:
                os.mkdir(w.name, DIR_MODE, dir_fd=w.parent_fd)
                return True
            except FileExistsError:
                mode = w.kind()
                if mode is None or not stat.S_ISDIR(mode):
                    raise invalid(f"{what} {w.path} exists and is not a directory") from None
                return False

    def make_file(self, value: str, what: str) -> bool:
        """Makes sure `value` is a non-symlink, non-directory file (creating missing parents);
        True when this call created it."""
        with self.walked(value, what, create_parents=True) as w:
            try:
                fd = os.open(
                    w.name,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    FILE_MODE,
                    dir_fd=w.parent_fd,
                )
                os.close(fd)
                return True
            except FileExistsError:
                mode = w.kind()
                if mode is None or stat.S_ISLNK(mode) or stat.S_ISDIR(mode):
                    raise invalid(f"{what} {w.path} exists and is not a file") from None
                return False

    def remove(self, value: str, what: str) -> None:
        """Removes a file or an empty directory the driver created; never recursive, never
        through a symlink. A missing path is fine."""
        try:
            with self.walked(value, what) as w:
                mode = w.kind()
                if mode is None:
                    return
                if stat.S_ISDIR(mode):
                    os.rmdir(w.name, dir_fd=w.parent_fd)
                else:
                    os.unlink(w.name, dir_fd=w.parent_fd)
        except FileNotFoundError:
            return

    def validate(self, value: str, what: str) -> str:
        """Checks a path and walks what exists of it: INVALID_ARGUMENT for a symlink on the way or
        at its end. Missing components are fine (they are made later, safely)."""
        path = self.check(value, what)
        try:
            with self.walked(path, what) as w:
                mode = w.kind()
                if mode is not None and stat.S_ISLNK(mode):
                    raise invalid(f"{what} {path} is a symbolic link; the driver never follows links")
        except FileNotFoundError:
            pass
        return path

    def exists(self, value: str, what: str) -> bool:
        """Whether the path exists, reached without following any symlink."""
        try:
            with self.walked(value, what) as w:
                mode = w.kind()
                return mode is not None and not stat.S_ISLNK(mode)
        except FileNotFoundError:
            return False
