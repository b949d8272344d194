"""What both ends of a unary call share, and both clients (`client`, `aio`): the gRPC
length-prefixed message (gRPC's PROTOCOL-HTTP2.md), the size limit, what an answer's status and
trailers say, and writing a message within HTTP/2's frame size and flow control window (with h2,
imported only by the blocking ends that use it)."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING

from .status import Code, RpcError, decode_message, parse_status

if TYPE_CHECKING:
    from h2.connection import H2Connection

# hpack logs every header it codes at debug level, which -v 4 turns on for the whole process:
# lines that grpcio, in C, never wrote.
logging.getLogger("hpack").setLevel(logging.INFO)

# grpcio's and grpc-go's default limit on a received message.
MAX_MESSAGE = 4 * 1024 * 1024
CONTENT_TYPE = "application/grpc"
USER_AGENT = "kubeloop-grpc-lite/1"
_PREFIX = struct.Struct(">BI")  # compressed flag, length

# HTTP statuses a gRPC client maps to a code when the answer is not gRPC at all (gRPC's
# http-grpc-status-mapping.md); any other is UNKNOWN.
_HTTP_CODES = {
    400: Code.INTERNAL,
    401: Code.UNAUTHENTICATED,
    403: Code.PERMISSION_DENIED,
    404: Code.UNIMPLEMENTED,
}
_HTTP_CODES.update(dict.fromkeys((429, 502, 503, 504), Code.UNAVAILABLE))


def connection(client_side: bool) -> H2Connection:
    """An HTTP/2 connection as gRPC peers expect it: str headers, inbound headers validated."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection

    return H2Connection(H2Configuration(client_side=client_side, header_encoding="utf-8"))


def answered(headers: Mapping[str, str], trailers: Mapping[str, str], body: bytes) -> bytes:
    """The message of a unary call's whole answer, or the RpcError its HTTP status, grpc-status
    or framing says."""
    status = headers.get(":status", "")
    if status != "200":
        code = _HTTP_CODES.get(int(status) if status.isdigit() else 0, Code.UNKNOWN)
        raise RpcError(code, f"Received http2 header with status: {status or 'none'}")
    # A trailers-only answer (an error, usually) carries grpc-status in its headers.
    trailers = trailers or headers
    if "grpc-status" not in trailers:
        raise RpcError(Code.UNKNOWN, "the server's answer carries no grpc-status")
    code = parse_status(trailers["grpc-status"])
    if code is not Code.OK:
        raise RpcError(code, decode_message(trailers.get("grpc-message", "")))
    return unframe(body)


def reset_code(error_code: int) -> Code:
    """The code of a call its peer reset (RST_STREAM), as grpcio maps HTTP/2's error codes."""
    return {8: Code.CANCELLED, 7: Code.UNAVAILABLE}.get(error_code, Code.INTERNAL)


def timeout_header(seconds: float) -> str:
    """grpc-timeout: at most 8 digits, in the finest unit that fits (milliseconds up to a day)."""
    for unit, per_second in (("m", 1000), ("S", 1), ("M", 1 / 60), ("H", 1 / 3600)):
        value = max(1, int(seconds * per_second))
        if value < 100_000_000:
            return f"{value}{unit}"
    return "99999999H"


def frame(message: bytes) -> bytes:
    return _PREFIX.pack(0, len(message)) + message


def unframe(data: bytes) -> bytes:
    """The one message of a unary call's body. Nothing is compressed: neither end offers an
    encoding (no grpc-accept-encoding), so a compressed flag is the peer's error."""
    if len(data) < _PREFIX.size:
        raise RpcError(Code.INTERNAL, f"truncated gRPC message ({len(data)} bytes)")
    compressed, length = _PREFIX.unpack_from(data)
    if compressed:
        raise RpcError(Code.INTERNAL, "compressed message received without grpc-encoding")
    if len(data) != _PREFIX.size + length:
        raise RpcError(Code.INTERNAL, f"gRPC message of {length} bytes in a body of {len(data)}")
    return data[_PREFIX.size :]


def check_size(body: bytes | bytearray) -> None:
    """Refuses a body once its prefix declares more than the limit, before buffering the rest
    (grpcio's wording), or once it runs past the one message a unary call carries."""
    if len(body) < _PREFIX.size:
        return
    _, length = _PREFIX.unpack_from(body)
    if length > MAX_MESSAGE:
        raise RpcError(
            Code.RESOURCE_EXHAUSTED, f"Received message larger than max ({length} vs. {MAX_MESSAGE})"
        )
    if len(body) > _PREFIX.size + length:
        raise RpcError(Code.INTERNAL, "more than one message in a unary call")


def send_message(conn: H2Connection, stream_id: int, message: bytes, end_stream: bool) -> None:
    """Queues one framed message in frames the peer takes. What is exchanged here (a few hundred
    bytes) is far below HTTP/2's initial 64 KiB window, so one that does not fit is refused
    rather than waited for."""
    data = frame(message)
    if len(data) > conn.local_flow_control_window(stream_id):
        raise RpcError(
            Code.RESOURCE_EXHAUSTED, f"message of {len(message)} bytes exceeds the flow-control window"
        )
    size = conn.max_outbound_frame_size
    chunks = [data[i : i + size] for i in range(0, len(data), size)] or [b""]
    for i, chunk in enumerate(chunks):
        conn.send_data(stream_id, chunk, end_stream=end_stream and i == len(chunks) - 1)


def flush(conn: H2Connection, sock: socket.socket) -> None:
    if data := conn.data_to_send():
        sock.sendall(data)
