"""What both ends of a unary call share: the gRPC length-prefixed message (gRPC's
PROTOCOL-HTTP2.md), the size limit, and writing a message within HTTP/2's frame size and flow
control window."""

from __future__ import annotations

import logging
import socket
import struct

from h2.config import H2Configuration
from h2.connection import H2Connection

from .status import Code, RpcError

# hpack logs every header it codes at debug level, which -v 4 turns on for the whole process:
# lines that grpcio, in C, never wrote.
logging.getLogger("hpack").setLevel(logging.INFO)

# grpcio's and grpc-go's default limit on a received message.
MAX_MESSAGE = 4 * 1024 * 1024
CONTENT_TYPE = "application/grpc"
_PREFIX = struct.Struct(">BI")  # compressed flag, length


def connection(client_side: bool) -> H2Connection:
    """An HTTP/2 connection as gRPC peers expect it: str headers, inbound headers validated."""
    return H2Connection(H2Configuration(client_side=client_side, header_encoding="utf-8"))


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
