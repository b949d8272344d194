"""Unix sockets as the CSI driver and the node sidecars serve them, whatever speaks on them
(grpcio in unix_grpc, grpc_lite in node-driver-registrar): the address forms flags take, a socket
that is 0600 from the moment it appears and replaces a stale one left by a killed process, and on
stop the removal of only the socket this process bound."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from .logs import get_logger

log = get_logger("grpc")

# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


def socket_path(address: str) -> str:
    """`unix:///run/csi.sock`, `unix:/run/csi.sock` or a plain path → the absolute path."""
    path = address
    for prefix in ("unix://", "unix:"):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    if not path:
        raise ValueError(f"address {address!r} names no socket path")
    return os.path.abspath(path)


def remove_stale_socket(path: str) -> None:
    """Removes a socket left by a killed process; refuses to remove anything else or a live socket."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)
            log.info("removed stale socket", path=path)
            return
    raise RuntimeError(f"another process is serving on {path}")


@contextlib.contextmanager
def publish(path: str, group: int | None = None) -> Iterator[str]:
    """Yields a private path to bind and start serving on; on leaving, the socket there is made
    0600 (0660 with `group` its group: a sidecar running as another user of that group may connect)
    and renamed to `path`.

    No umask games (the umask is process-wide, other threads create files meanwhile): the socket is
    bound inside a fresh 0700 directory nobody else can enter, made 0600 there, then renamed into
    place; the server keeps serving the renamed inode."""
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path} is {len(path.encode())} bytes; unix sockets allow {MAX_SOCKET_PATH}"
        )
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    remove_stale_socket(path)
    private = tempfile.mkdtemp(prefix=".", dir=directory)
    bound = os.path.join(private, "s")
    try:
        if len(bound.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket directory {directory} is too long to bind a socket in it")
        yield bound
        if group is None:
            os.chmod(bound, 0o600)
        else:
            os.chown(bound, -1, group)
            os.chmod(bound, 0o660)
        os.rename(bound, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(bound)
        os.rmdir(private)


@dataclass(frozen=True)
class SocketFile:
    """A socket this process published at `path`."""

    path: str
    inode: int  # of the socket file we bound: a successor's socket at the same path is not ours

    @classmethod
    def at(cls, path: str) -> SocketFile:
        return cls(path, os.lstat(path).st_ino)

    def is_ours(self) -> bool:
        """Whether the path still holds the socket this process bound."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self.inode

    def remove(self) -> None:
        """Removes the socket if it is still ours: a replacement process may already serve at this
        path (it found our socket dead and bound its own), and removing its socket would cut it off."""
        with contextlib.suppress(FileNotFoundError):
            if self.is_ours():
                os.unlink(self.path)
