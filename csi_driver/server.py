"""The interceptor the driver's CSI and registration servers share (their sockets come from
controller_runtime.unix_grpc): it turns every outcome into a CSI status code, logs it and records
the `csi_operations_seconds` histogram."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from controller_runtime.logs import get_logger
from controller_runtime.metrics import Histogram

from . import DRIVER_NAME
from .backend.files import UnsafePoolFile
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


# A status message travels percent-encoded in a header (up to 3 bytes for each byte of UTF-8), and
# gRPC refuses headers over 16 KiB: the client then sees RESOURCE_EXHAUSTED instead of the answer.
# Messages quote values from requests, which may be that long: they are cut here, once for every
# RPC, whatever built them, at a size whose encoding always fits.
MAX_MESSAGE_BYTES = 2048


def _bounded(message: str) -> str:
    encoded = message.encode("utf-8", "backslashreplace")
    if len(encoded) <= MAX_MESSAGE_BYTES:
        return message
    kept = encoded[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")  # never half a character
    return f"{kept}... ({len(encoded) - MAX_MESSAGE_BYTES} more bytes)"


@dataclass(frozen=True)
class _Undecodable:
    error: str


class CsiInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, driver: str = DRIVER_NAME) -> None:
        self.driver = driver  # the driver_name label of the operation metric

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
                OPERATIONS.labels(self.driver, method, grpc.StatusCode.INVALID_ARGUMENT.name).observe(0)
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
            except UnsafePoolFile as e:
                # A pool entry swapped for a symlink or a special file: nothing is wrong with the
                # request, and nothing changes until an operator puts the real file back.
                code, message = grpc.StatusCode.FAILED_PRECONDITION, f"refusing a pool file: {e.strerror}"
            except asyncio.CancelledError:
                code, message = grpc.StatusCode.CANCELLED, "client cancelled; the operation continues"
                raise
            except Exception as e:
                log.exception("unexpected error", method=method)
                code, message = grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
            finally:
                elapsed = time.monotonic() - start
                OPERATIONS.labels(self.driver, method, code.name).observe(elapsed)
                fields = {"method": method, "code": code.name, "ms": round(elapsed * 1000, 1)}
                if code != grpc.StatusCode.OK:
                    log.warning("rpc failed", **fields, error=message)
                elif method in _QUIET:
                    log.debug("rpc", **fields)
                else:
                    log.info("rpc", **fields)
            await context.abort(code, _bounded(message))

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=deserialize,
            response_serializer=handler.response_serializer,
        )
