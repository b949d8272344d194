"""gRPC status codes and the error a call ends with, worded as grpcio and Go's grpc word them, so
the log lines and /healthz bodies of the node sidecars read as they did on grpcio."""

from __future__ import annotations

import enum
from urllib.parse import quote, unquote


class Code(enum.IntEnum):
    """grpc.StatusCode's names and numbers (the metric label `grpc_status_code` is the name)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


def go_name(name: str) -> str:
    """A code's name as Go's codes.Code prints it (`InvalidArgument`, `Canceled`)."""
    camel = "".join(part.capitalize() for part in name.split("_"))
    return {"Ok": "OK", "Cancelled": "Canceled"}.get(camel, camel)  # Go spells these so


class RpcError(Exception):
    """A call that ended with a status other than OK."""

    def __init__(self, code: Code, details: str) -> None:
        super().__init__(f"rpc error: code = {go_name(code.name)} desc = {details}")
        self.code = code
        self.details = details


def parse_status(value: str | None) -> Code:
    """grpc-status as received; a number no code has is UNKNOWN, as in grpcio."""
    try:
        return Code(int(value or ""))
    except ValueError:
        return Code.UNKNOWN


# grpc-message is percent-encoded UTF-8 (gRPC's PROTOCOL-HTTP2.md): every byte outside printable
# ASCII, and % itself.
_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def encode_message(details: str) -> str:
    return quote(details, safe=_MESSAGE_SAFE)


def decode_message(value: str) -> str:
    return unquote(value, errors="replace")
