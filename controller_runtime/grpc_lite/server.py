"""A unary gRPC server on a unix socket, one thread per connection (h2 for HTTP/2): what
node-driver-registrar serves kubelet's plugin watcher, a grpc-go client.

Handlers take the request's bytes and return the response's, or raise RpcError; anything else they
raise is answered UNKNOWN. Errors go out as trailers-only responses (status 200, grpc-status and
grpc-message in the one HEADERS frame), an unknown method as UNIMPLEMENTED worded as grpc-go words
it. A peer that sends what is not HTTP/2, goes quiet for IDLE_S, or closes mid-frame loses its
connection and nothing else; h2 answers SETTINGS, PING and WINDOW_UPDATE."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

import h2.events
import h2.exceptions
from h2.connection import H2Connection
from h2.errors import ErrorCodes

from ..logs import get_logger
from ..socket_threads import ThreadedListener
from ..unix_sockets import SocketFile, publish
from . import framing
from .status import Code, RpcError, encode_message
from .wire import DecodeError

log = get_logger("grpc")

Handler = Callable[[bytes], bytes]

# How long a connection may stay silent before it is dropped: kubelet's plugin watcher dials, makes
# its two calls and hangs up; a peer that connects and says nothing must not hold a thread forever.
IDLE_S = 300.0


@dataclass
class _Stream:
    headers: dict[str, str]
    body: bytearray = field(default_factory=bytearray)
    refused: RpcError | None = None  # a body over the size limit: answered once the request ends


class Server:
    def __init__(self, handlers: dict[str, Handler]) -> None:
        self._handlers = handlers
        self._listener: ThreadedListener | None = None
        self.socket: SocketFile | None = None

    def start(self, path: str, group: int | None = None) -> SocketFile:
        """Serves on `path`, published as unix_sockets.publish does (0600, or 0660 to `group`)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with publish(path, group) as bound:
                listener.bind(bound)
                listener.listen(64)
        except BaseException:
            listener.close()
            raise
        self.socket = SocketFile.at(path)
        self._listener = ThreadedListener(listener, self._serve, "grpc")
        self._listener.start()
        log.info("serving gRPC", socket=path, **({"group": group} if group is not None else {}))
        return self.socket

    def stop(self, grace: float) -> None:
        """Stops accepting, closes every connection (waiting up to `grace` seconds for each), and
        removes the socket if it is still ours."""
        if self._listener is not None:
            self._listener.stop(grace)
        if self.socket is not None:
            self.socket.remove()
            log.info("stopped gRPC server", socket=self.socket.path)

    def connections(self) -> int:
        return 0 if self._listener is None else self._listener.threads()

    def _serve(self, sock: socket.socket) -> None:
        conn = framing.connection(client_side=False)
        streams: dict[int, _Stream] = {}
        try:
            conn.initiate_connection()
            framing.flush(conn, sock)
            sock.settimeout(IDLE_S)
            while True:
                data = sock.recv(65536)
                if not data:
                    return  # the peer hung up (perhaps mid-frame: nothing is left to answer)
                for event in conn.receive_data(data):
                    self._take(conn, event, streams)
                framing.flush(conn, sock)
        except h2.exceptions.ProtocolError as e:
            # Not HTTP/2 (a stray client, garbage): h2 has queued a GOAWAY; send it and hang up.
            log.debug("dropping a connection that broke HTTP/2", error=str(e))
            with contextlib.suppress(OSError):
                framing.flush(conn, sock)
        except OSError as e:  # closed under it, or silent for IDLE_S (TimeoutError)
            log.debug("connection closed", error=str(e))

    def _take(self, conn: H2Connection, event: h2.events.Event, streams: dict[int, _Stream]) -> None:
        if isinstance(event, h2.events.RequestReceived) and event.stream_id is not None:
            streams[event.stream_id] = _Stream({str(k): str(v) for k, v in event.headers or ()})
        elif isinstance(event, h2.events.DataReceived) and event.stream_id in streams:
            stream = streams[event.stream_id]
            if event.flow_controlled_length:
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            if stream.refused is None:
                stream.body += event.data or b""
                try:
                    framing.check_size(stream.body)
                except RpcError as e:
                    stream.refused, stream.body = e, bytearray()
        elif isinstance(event, h2.events.StreamEnded) and event.stream_id in streams:
            self._answer(conn, event.stream_id, streams.pop(event.stream_id))
        elif isinstance(event, h2.events.StreamReset) and event.stream_id is not None:
            streams.pop(event.stream_id, None)  # the client gave up (its deadline): nothing to send

    def _answer(self, conn: H2Connection, stream_id: int, stream: _Stream) -> None:
        headers = stream.headers
        if headers.get(":method") != "POST":
            conn.send_headers(stream_id, [(":status", "405")], end_stream=True)
            return
        if not headers.get("content-type", "").startswith(framing.CONTENT_TYPE):
            conn.send_headers(stream_id, [(":status", "415")], end_stream=True)  # as grpc-go answers
            return
        try:
            if stream.refused is not None:
                raise stream.refused
            handler = self._handlers.get(headers.get(":path", ""))
            if handler is None:
                raise RpcError(Code.UNIMPLEMENTED, _unknown(headers.get(":path", ""), self._handlers))
            response = handler(framing.unframe(bytes(stream.body)))
        except RpcError as e:
            _trailers_only(conn, stream_id, e.code, e.details)
            return
        except DecodeError as e:  # grpc-go's words for a request that is not the method's message
            _trailers_only(conn, stream_id, Code.INTERNAL, f"grpc: error unmarshalling request: {e}")
            return
        except Exception as e:
            log.exception("a gRPC handler failed", method=headers.get(":path"))
            _trailers_only(conn, stream_id, Code.UNKNOWN, f"{type(e).__name__}: {e}")
            return
        conn.send_headers(stream_id, [(":status", "200"), ("content-type", framing.CONTENT_TYPE)])
        try:
            framing.send_message(conn, stream_id, response, end_stream=False)
        except RpcError as e:
            conn.reset_stream(stream_id, ErrorCodes.INTERNAL_ERROR)
            log.error("a gRPC response could not be sent", method=headers.get(":path"), error=e.details)
            return
        conn.send_headers(stream_id, [("grpc-status", "0")], end_stream=True)


def _trailers_only(conn: H2Connection, stream_id: int, code: Code, details: str) -> None:
    conn.send_headers(
        stream_id,
        [
            (":status", "200"),
            ("content-type", framing.CONTENT_TYPE),
            ("grpc-status", str(int(code))),
            ("grpc-message", encode_message(details)),
        ],
        end_stream=True,
    )


def _unknown(path: str, handlers: dict[str, Handler]) -> str:
    """grpc-go's words for a method it does not serve."""
    service, _, method = path.lstrip("/").rpartition("/")
    if any(known.lstrip("/").rpartition("/")[0] == service for known in handlers):
        return f"unknown method {method} for service {service}"
    return f"unknown service {service or path}"
