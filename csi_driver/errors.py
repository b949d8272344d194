"""Every failure a client sees is a CSI status code with a sentence an operator can act on."""

from __future__ import annotations

import grpc


class CsiError(Exception):
    """Raised anywhere below a gRPC handler; the server interceptor turns it into the status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def not_found(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.NOT_FOUND, message)


def already_exists(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.ALREADY_EXISTS, message)


def failed_precondition(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.FAILED_PRECONDITION, message)


def out_of_range(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.OUT_OF_RANGE, message)


def exhausted(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def aborted(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.ABORTED, message)


def unimplemented(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.UNIMPLEMENTED, message)


def unavailable(message: str) -> CsiError:
    return CsiError(grpc.StatusCode.UNAVAILABLE, message)
