"""gRPC over unix sockets, for the CSI driver and the node sidecars: the address forms flags take,
and a server whose socket is 0600 from the moment it appears, replaces a stale one left by a killed
process, and on stop removes only the socket it bound."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

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


@dataclass(frozen=True)
class UnixServer:
    server: grpc.aio.Server
    path: str
    inode: int  # of the socket file we bound: a successor's socket at the same path is not ours

    def is_ours(self) -> bool:
        """Whether the path still holds the socket this server bound."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(st.st_mode) and st.st_ino == self.inode


async def start_unix_server(
    path: str,
    register: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    group: int | None = None,
) -> UnixServer:
    """Serves gRPC on a unix socket at `path`, 0600 to its owner, or 0660 with `group` its group (a
    sidecar running as another user of that group may connect)."""
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path} is {len(path.encode())} bytes; unix sockets allow {MAX_SOCKET_PATH}"
        )
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    remove_stale_socket(path)
    server = grpc.aio.server(interceptors=list(interceptors))
    register(server)
    # No umask games (the umask is process-wide, other tasks create files meanwhile): the socket
    # is bound inside a fresh 0700 directory nobody else can enter, made 0600 there, then renamed
    # into place. The server keeps serving the renamed inode.
    private = tempfile.mkdtemp(prefix=".", dir=directory)
    try:
        bound = os.path.join(private, "s")
        if len(bound.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket directory {directory} is too long to bind a socket in it")
        server.add_insecure_port(f"unix://{bound}")
        await server.start()
        if group is None:
            os.chmod(bound, 0o600)
        else:
            os.chown(bound, -1, group)
            os.chmod(bound, 0o660)
        os.rename(bound, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(private, "s"))
        os.rmdir(private)
    log.info("serving gRPC", socket=path, **({"group": group} if group is not None else {}))
    return UnixServer(server, path, os.lstat(path).st_ino)


async def stop_unix_server(unix: UnixServer, grace: float) -> None:
    try:
        await unix.server.stop(grace)
    finally:
        # A replacement process may already serve at this path (it found our socket dead and bound
        # its own); removing its socket would cut it off, so only the file we bound goes. (grpc
        # unlinks only the path it bound, the private one, which the rename already emptied.)
        with contextlib.suppress(FileNotFoundError):
            if unix.is_ours():
                os.unlink(unix.path)
        log.info("stopped gRPC server", socket=unix.path)
