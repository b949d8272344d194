"""A unary gRPC client on one blocking unix-socket connection (h2 for HTTP/2).

`Channel(address).call("/csi.v1.Identity/Probe", request, timeout)` sends one request and returns
the response's bytes, or raises RpcError with the code and message the server's trailers carry.
Failures of the transport are worded as grpcio words them (`failed to connect to all addresses`,
`Deadline Exceeded`, `Socket closed`), so the sidecars' log lines and /healthz bodies keep reading
as they did."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from dataclasses import dataclass, field

import h2.events
import h2.exceptions
from h2.connection import H2Connection

from ..unix_sockets import socket_path
from . import framing
from .status import Code, RpcError


@dataclass
class _Answer:
    """What one call has received so far."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    trailers: dict[str, str] = field(default_factory=dict)
    ended: bool = False

    def result(self) -> bytes:
        return framing.answered(self.headers, self.trailers, bytes(self.body))


class Channel:
    """One connection to a unix socket (`unix:///path`, `unix:path` or a path), made on the first
    call and reused by the next; any failure drops it, and the next call connects anew. Calls on
    one channel are serialized."""

    def __init__(self, address: str) -> None:
        self.path = socket_path(address)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._conn: H2Connection | None = None

    def call(self, method: str, request: bytes, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                return self._call(method, request, deadline)
            except BaseException:
                self._drop()
                raise

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
        self._sock = self._conn = None

    def _connect(self, deadline: float) -> tuple[socket.socket, H2Connection]:
        if self._sock is not None and self._conn is not None:
            return self._sock, self._conn
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(self.path)
        except TimeoutError:
            sock.close()
            raise RpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except OSError as e:
            sock.close()
            reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
            target = f"unix:{self.path}"  # grpcio's words, which the sidecars' log lines and /healthz carried
            raise RpcError(
                Code.UNAVAILABLE,
                f"failed to connect to all addresses; last error: FAILED_PRECONDITION: {target}: "
                f"connect failed: addr: {target} error: {reason}",
            ) from None
        conn = framing.connection(client_side=True)
        conn.initiate_connection()
        self._sock, self._conn = sock, conn
        return sock, conn

    def _call(self, method: str, request: bytes, deadline: float) -> bytes:
        sock, conn = self._connect(deadline)
        stream_id = conn.get_next_available_stream_id()
        conn.send_headers(
            stream_id,
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", method),
                (":authority", "localhost"),  # what grpcio sends for a unix: target
                ("content-type", framing.CONTENT_TYPE),
                ("te", "trailers"),
                ("grpc-timeout", framing.timeout_header(_remaining(deadline))),
                ("user-agent", framing.USER_AGENT),
            ],
        )
        framing.send_message(conn, stream_id, request, end_stream=True)
        answer = _Answer()
        try:
            framing.flush(conn, sock)
            while not answer.ended:
                sock.settimeout(_remaining(deadline))
                data = sock.recv(65536)
                if not data:
                    raise RpcError(Code.UNAVAILABLE, "Socket closed")
                for event in conn.receive_data(data):
                    _take(conn, stream_id, event, answer)
                framing.flush(conn, sock)
        except TimeoutError:
            raise RpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except h2.exceptions.ProtocolError as e:
            raise RpcError(Code.UNAVAILABLE, f"connection error: {e}") from None
        except OSError as e:
            raise RpcError(Code.UNAVAILABLE, f"Socket closed ({e.strerror or e})") from None
        return answer.result()


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RpcError(Code.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return left


def _take(conn: H2Connection, stream_id: int, event: h2.events.Event, answer: _Answer) -> None:
    """One HTTP/2 event of the connection, as it bears on the call on `stream_id`."""
    if isinstance(event, h2.events.ConnectionTerminated):
        # Even a graceful GOAWAY (a server stopping, which would still answer the calls it took)
        # ends the call: h2 closes the connection on any GOAWAY and refuses the frames after it.
        # The callers ask again (the registrar's wait) or fail a probe of a driver going away.
        raise RpcError(
            Code.UNAVAILABLE, f"the server closed the connection (GOAWAY, error {event.error_code})"
        )
    if getattr(event, "stream_id", stream_id) != stream_id:
        return
    if isinstance(event, h2.events.ResponseReceived):
        answer.headers = _headers(event.headers)
    elif isinstance(event, h2.events.DataReceived):
        answer.body += event.data
        framing.check_size(answer.body)
        # Gives the window back, so a server sending more than 64 KiB is not left waiting.
        conn.acknowledge_received_data(event.flow_controlled_length, stream_id)
    elif isinstance(event, h2.events.TrailersReceived):
        answer.trailers = _headers(event.headers)
    elif isinstance(event, h2.events.StreamEnded):
        answer.ended = True
    elif isinstance(event, h2.events.StreamReset):
        raise RpcError(
            framing.reset_code(int(event.error_code)),
            f"Received RST_STREAM with error code {int(event.error_code)}",
        )


def _headers(headers: object) -> dict[str, str]:
    return {str(name): str(value) for name, value in headers}  # type: ignore[attr-defined]
