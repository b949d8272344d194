"""The node agent's timestamp and error texts (kept here until controller_runtime has shared ones)."""

from __future__ import annotations

import time

import grpc


def _rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _message(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"rpc error: code = {exc.code().name} desc = {exc.details()}"
    return str(exc) or type(exc).__name__
