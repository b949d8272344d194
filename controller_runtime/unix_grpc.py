"""gRPC over unix sockets, for the CSI driver and the node sidecars: a grpcio server on a socket
published as controller_runtime.unix_sockets publishes it (0600 from the moment it appears, a stale
one replaced, on stop only the socket it bound removed). The address forms flags take are
unix_sockets', imported from here too."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from .logs import get_logger
from .unix_sockets import MAX_SOCKET_PATH, SocketFile, publish, remove_stale_socket, socket_path

__all__ = [
    "MAX_SOCKET_PATH",
    "UnixServer",
    "remove_stale_socket",
    "socket_path",
    "start_unix_server",
    "stop_unix_server",
]

log = get_logger("grpc")


@dataclass(frozen=True)
class UnixServer(SocketFile):
    server: grpc.aio.Server


async def start_unix_server(
    path: str,
    register: Callable[[grpc.aio.Server], None],
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    group: int | None = None,
) -> UnixServer:
    """Serves gRPC on a unix socket at `path`, 0600 to its owner, or 0660 with `group` its group (a
    sidecar running as another user of that group may connect)."""
    server = grpc.aio.server(interceptors=list(interceptors))
    register(server)
    with publish(path, group) as bound:
        server.add_insecure_port(f"unix://{bound}")
        await server.start()
    log.info("serving gRPC", socket=path, **({"group": group} if group is not None else {}))
    return UnixServer(path, os.lstat(path).st_ino, server)


async def stop_unix_server(unix: UnixServer, grace: float) -> None:
    try:
        await unix.server.stop(grace)
    finally:
        # Only the file we bound goes (grpc unlinks only the path it bound, the private one, which
        # the rename already emptied).
        unix.remove()
        log.info("stopped gRPC server", socket=unix.path)
