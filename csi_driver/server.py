"""gRPC plumbing shared by the CSI and registration servers: a unix socket with mode 0600 that
replaces a stale one, and one interceptor that turns every outcome into a CSI status code, logs
it and records the `csi_operations_seconds` histogram."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import Histogram

from controller_runtime.logs import get_logger

from . import DRIVER_NAME
from .backend.tools import ToolError
from .errors import CsiError

log = get_logger("csi.server")

# Named and labelled like the sidecars' csi_sidecar_operations_seconds, seen from the driver side.
OPERATIONS = Histogram(
    "csi_operations_seconds",
    "Duration of CSI operations served by the driver, by method and gRPC status code",
    ["driver_name", "method_name", "grpc_status_code"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)

# Calls that only read: logged at debug level so a CO polling Probe does not flood the log.
_QUIET = {
    "Probe",
    "GetPluginInfo",
    "GetPluginCapabilities",
    "ControllerGetCapabilities",
    "NodeGetCapabilities",
    "NodeGetInfo",
    "GetCapacity",
    "ListVolumes",
    "ListSnapshots",
    "NodeGetVolumeStats",
    "ControllerGetVolume",
    "GetSnapshot",
    "GetInfo",
}

Behaviour = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


def socket_path(endpoint: str) -> str:
    """`unix:///run/csi.sock`, `unix:/run/csi.sock` or a plain path → the absolute path."""
    path = endpoint
    for prefix in ("unix://", "unix:"):
        if path.startswith(prefix):
            path = path[len(prefix) :]
            break
    if not path:
        raise ValueError(f"endpoint {endpoint!r} names no socket path")
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
class _Undecodable:
    error: str


class CsiInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = details.method.rsplit("/", 1)[-1]
        behaviour: Behaviour = handler.unary_unary
        decode = handler.request_deserializer

        def deserialize(data: bytes) -> Any:
            # grpc answers UNKNOWN when a deserializer raises (e.g. a string field that is not
            # UTF-8, which proto3 forbids): hand the error on, to be answered INVALID_ARGUMENT.
            try:
                return decode(data) if decode is not None else data
            except Exception as e:
                return _Undecodable(f"{type(e).__name__}: {e}")

        async def wrapped(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = time.monotonic()
            if isinstance(request, _Undecodable):
                message = f"the request is not a valid {method} message: {request.error}"
                OPERATIONS.labels(DRIVER_NAME, method, grpc.StatusCode.INVALID_ARGUMENT.name).observe(0)
                log.warning("rpc failed", method=method, code="INVALID_ARGUMENT", error=message)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            # Shielded: a CO that gives up (deadline) must not interrupt an operation half way;
            # it finishes under the volume's lock and the CO's retry finds its result.
            task = asyncio.ensure_future(behaviour(request, context))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            code, message = grpc.StatusCode.OK, ""
            try:
                return await asyncio.shield(task)
            except CsiError as e:
                code, message = e.code, e.message
            except ToolError as e:
                code, message = grpc.StatusCode.INTERNAL, str(e)
            except asyncio.CancelledError:
                code, message = grpc.StatusCode.CANCELLED, "client cancelled; the operation continues"
                raise
            except Exception as e:
                log.exception("unexpected error", method=method)
                code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
            finally:
                elapsed = time.monotonic() - start
                OPERATIONS.labels(DRIVER_NAME, method, code.name).observe(elapsed)
                fields = {"method": method, "code": code.name, "ms": round(elapsed * 1000, 1)}
                if code != grpc.StatusCode.OK:
                    log.warning("rpc failed", **fields, error=message)
                elif method in _QUIET:
                    log.debug("rpc", **fields)
                else:
                    log.info("rpc", **fields)
            await context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )


# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107


@dataclass(frozen=True)
class UnixServer:
    server: grpc.aio.Server
    path: str
    inode: int  # of the socket file we bound: a successor's socket at the same path is not ours


async def start_unix_server(path: str, register: Callable[[grpc.aio.Server], None]) -> UnixServer:
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ValueError(
            f"socket path {path} is {len(path.encode())} bytes; unix sockets allow {MAX_SOCKET_PATH}"
        )
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    remove_stale_socket(path)
    server = grpc.aio.server(interceptors=[CsiInterceptor()])
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
        os.chmod(bound, 0o600)
        os.rename(bound, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(private, "s"))
        os.rmdir(private)
    log.info("serving gRPC", socket=path)
    return UnixServer(server, path, os.lstat(path).st_ino)


async def stop_unix_server(unix: UnixServer, grace: float) -> None:
    try:
        await unix.server.stop(grace)
    finally:
        # A replacement process may already serve at this path (it found our socket dead and bound
        # its own); removing its socket would cut it off, so only the file we bound goes. (grpc
        # unlinks only the path it bound, the private one, which the rename already emptied.)
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(unix.path).st_ino == unix.inode:
                os.unlink(unix.path)
        log.info("stopped gRPC server", socket=unix.path)
