"""A grpc.aio channel for unary calls over a unix socket, run on the event loop itself: HTTP/2 framed
here, HPACK answers decoded by the hpack package. The sidecars' CSI connection uses it
(controller_runtime.csi_client).

grpcio's asyncio channel hands every call to its own threads (the event engine's and a poller
that wakes the loop): a CreateVolume cost the provisioner 235 us of CPU, 90 of them on those
threads, measured with 50 calls in flight. Here a call is two frames written in one send and
parsed where they arrive, about half that. What grpcio's callers rely on stays: the generated stubs
take this channel (`unary_unary`), a call that fails raises `grpc.aio.AioRpcError` with grpcio's
code and wording (`failed to connect to all addresses`, `Deadline Exceeded`, `Socket closed`), a
deadline travels as `grpc-timeout`, a deadline or a cancel resets the stream (RST_STREAM CANCEL),
and the connection is made on the first call and again after it breaks.

Only unary calls are made (CSI has no other kind on the sidecars' side); a request waits for the
peer's flow-control window, an answer may be as large as grpcio accepts (4 MiB)."""

from __future__ import annotations

import asyncio
import errno
import struct
from collections.abc import Callable
from typing import Any, cast

import grpc
from hpack import Decoder
from hpack.exceptions import HPACKError

from ..unix_sockets import socket_path
from . import framing
from .status import Code, RpcError

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PUSH_PROMISE, _PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = (
    0, 1, 3, 4, 5, 6, 7, 8, 9,
)  # fmt: skip
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20
_FRAME = struct.Struct(">BHBBI")  # length (24 bits, as 8 + 16), type, flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_CANCEL = 0x8
_SETTINGS_INITIAL_WINDOW_SIZE, _SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
# What a peer may send before its window is full: every answer grpcio accepts, at once.
_WINDOW = framing.MAX_MESSAGE + 1024
_CONNECTION_WINDOW = 4 * _WINDOW
_DEFAULT_WINDOW = 65_535
_MAX_FRAME = 16_384  # the largest frame either end sends unless its peer's SETTINGS allow more
_STATUS_CODES = {c.value[0]: c for c in grpc.StatusCode}
# Header blocks remembered at most (answers with error messages differ from one call to the next).
_REMEMBERED_BLOCKS = 64


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _FRAME.pack(n >> 16, n & 0xFFFF, kind, flags, stream) + payload


def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """HPACK's integer with an N-bit prefix (RFC 7541, 5.1); `first` holds the byte's other bits."""
    top = (1 << prefix_bits) - 1
    if value < top:
        return bytes((first | value,))
    out = bytearray((first | top,))
    value -= top
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: int | str, value: str) -> bytes:
    """A header field without indexing (RFC 7541, 6.2.2), its name a static-table index or
    literal, no Huffman coding: nothing is added to the peer's table, so no state is shared."""
    data = value.encode()
    if isinstance(name, int):
        head = _int(name, 4)
    else:
        raw = name.encode()
        head = b"\x00" + _int(len(raw), 7) + raw
    return head + _int(len(data), 7) + data


# A call's headers around its :path (pseudo-headers first, as HTTP/2 requires): :method POST and
# :scheme http are static entries 3 and 6; :authority is what grpcio sends for a unix: target;
# content-type (31), te and user-agent (58) as grpcio sends them.
_BEFORE_PATH = b"\x83\x86"
_AFTER_PATH = (
    _literal(1, "localhost")
    + _literal(31, framing.CONTENT_TYPE)
    + _literal("te", "trailers")
    + _literal(58, framing.USER_AGENT)
)


def _read_int(block: bytes, i: int, prefix_bits: int) -> tuple[int, int]:
    """The HPACK integer at `block[i]` with an N-bit prefix (RFC 7541, 5.1), and where it ends."""
    top = (1 << prefix_bits) - 1
    value = block[i] & top
    i += 1
    if value < top:
        return value, i
    shift = 0
    while True:
        byte = block[i]
        i += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _after_string(block: bytes, i: int) -> int:
    length, i = _read_int(block, i, 7)  # the top bit is the Huffman flag, not the length's
    return i + length


def _changes_table(block: bytes) -> bool:
    """Whether decoding the header block adds to the dynamic table or resizes it (RFC 7541, 6):
    a literal with incremental indexing or a size update. Indexed fields and literals without
    (or never) indexing leave it as it is."""
    i = 0
    while i < len(block):
        first = block[i]
        if first & 0x80:
            _, i = _read_int(block, i, 7)
        elif (first & 0xE0) in (0x40, 0x60, 0x20):
            return True
        else:
            literal_name = first & 0x0F == 0
            _, i = _read_int(block, i, 4)
            if literal_name:
                i = _after_string(block, i)
            i = _after_string(block, i)
    return False


def _error(code: Code, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(_STATUS_CODES[int(code)], grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Call:
    __slots__ = ("body", "done", "headers", "id", "outbox", "trailers", "window")

    def __init__(self, stream_id: int, done: asyncio.Future[None], window: int, outbox: bytes) -> None:
        self.id = stream_id
        self.done = done
        self.window = window  # what the peer takes on this stream before a WINDOW_UPDATE
        self.outbox = outbox  # the framed request not yet sent (flow control)
        self.headers: dict[str, str] = {}
        self.trailers: dict[str, str] = {}
        self.body = bytearray()

    def fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection carrying any number of calls at once."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._accepting = True  # no GOAWAY, stream ids left
        self._lost = False
        self._calls: dict[int, _Call] = {}
        self._next_id = 1
        self._buf = bytearray()
        self._decoder = Decoder()
        self._decoded: dict[bytes, dict[str, str]] = {}
        self._block = bytearray()  # a header block being received in HEADERS + CONTINUATIONs
        self._block_stream = 0
        self._block_end = False
        self._send_window = _DEFAULT_WINDOW  # the connection's
        self._initial_window = _DEFAULT_WINDOW  # each new stream's, from the peer's SETTINGS
        self._max_frame = _MAX_FRAME  # the peer's, from its SETTINGS
        self._unacked = 0  # DATA received since the last connection WINDOW_UPDATE

    # -- asyncio.Protocol ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        # No server push (ENABLE_PUSH 0); every answer fits its stream's window.
        settings = _SETTING.pack(0x2, 0) + _SETTING.pack(_SETTINGS_INITIAL_WINDOW_SIZE, _WINDOW)
        transport.write(
            _PREFACE
            + _frame(_SETTINGS, 0, 0, settings)
            + _frame(_WINDOW_UPDATE, 0, 0, _U32.pack(_CONNECTION_WINDOW - _DEFAULT_WINDOW))
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        reason = f"Socket closed ({exc})" if exc is not None else "Socket closed"
        self._fail_all(_error(Code.UNAVAILABLE, reason))

    def data_received(self, data: bytes) -> None:
        if self._lost:
            return  # broken: what follows is not read
        buf = self._buf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= 9:
                hi, lo, kind, flags, stream = _FRAME.unpack_from(buf, pos)
                length = hi << 16 | lo
                if length > _MAX_FRAME:  # what this end's SETTINGS allow (HTTP/2's default)
                    raise ValueError(f"a frame of {length} bytes, over {_MAX_FRAME}")
                end = pos + 9 + length
                if len(buf) < end:
                    break
                self._frame(kind, flags, stream & 0x7FFFFFFF, bytes(buf[pos + 9 : end]))
                pos = end
        except (RpcError, HPACKError, ValueError, IndexError, struct.error) as e:
            self._broken(f"connection error: {e}")
        finally:
            del buf[:pos]

    # -- calls --------------------------------------------------------------------------------------

    def start(self, method: str, message: bytes, timeout: float | None) -> _Call:
        """Sends a call's HEADERS and, as the peer's windows allow, its DATA."""
        transport = self.transport
        if transport is None or not self._open():
            raise _error(Code.UNAVAILABLE, "Socket closed")  # lost before the call could start
        stream_id = self._next_id
        self._next_id += 2
        if self._next_id >= 1 << 31:
            self._accepting = False  # stream ids spent: the next call opens a new connection
        block = _BEFORE_PATH + _literal(4, method) + _AFTER_PATH
        if timeout is not None:
            block += _literal("grpc-timeout", framing.timeout_header(timeout))
        call = _Call(
            stream_id,
            asyncio.get_running_loop().create_future(),
            self._initial_window,
            framing.frame(message),
        )
        self._calls[stream_id] = call
        transport.write(_frame(_HEADERS, _END_HEADERS, stream_id, block) + self._sendable(call))
        return call

    def reset(self, call: _Call) -> None:
        """Ends a call the caller gave up on (its deadline, a cancel), telling the peer."""
        if self._calls.pop(call.id, None) is not None and self._open():
            assert self.transport is not None
            self.transport.write(_frame(_RST_STREAM, 0, call.id, _U32.pack(_CANCEL)))

    @property
    def usable(self) -> bool:
        """Whether a new call may start here: open, no GOAWAY, stream ids left."""
        return self._accepting and self._open()

    def _open(self) -> bool:
        # A transport that met the peer's EOF is closing before connection_lost is called.
        return self.transport is not None and not self._lost and not self.transport.is_closing()

    def close(self) -> None:
        self._accepting = False
        if self.transport is not None:
            self.transport.close()

    def _sendable(self, call: _Call) -> bytes:
        """The DATA frames of `call`'s request the windows take now (the last one ends the stream)."""
        frames = []
        while call.outbox:
            n = min(len(call.outbox), self._max_frame, call.window, self._send_window)
            if n <= 0:
                break
            piece, call.outbox = call.outbox[:n], call.outbox[n:]
            call.window -= n
            self._send_window -= n
            frames.append(_frame(_DATA, 0 if call.outbox else _END_STREAM, call.id, piece))
        return b"".join(frames)

    def _flush_waiting(self) -> None:
        assert self.transport is not None
        out = b"".join(self._sendable(c) for c in self._calls.values() if c.outbox)
        if out:
            self.transport.write(out)

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.fail(error)

    def _broken(self, reason: str) -> None:
        self._accepting = False
        self._lost = True
        self._fail_all(_error(Code.UNAVAILABLE, reason))
        if self.transport is not None:
            self.transport.abort()

    # -- frames -------------------------------------------------------------------------------------

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self._block_stream and kind != _CONTINUATION:
            raise ValueError("a header block interrupted by another frame")
        if kind == _DATA:
            self._data(flags, stream, payload)
        elif kind == _HEADERS:
            if flags & _PADDED:
                payload = payload[1 : len(payload) - payload[0]]
            if flags & _PRIORITY:
                payload = payload[5:]
            self._block, self._block_stream, self._block_end = (
                bytearray(payload),
                stream,
                bool(flags & _END_STREAM),
            )
            if flags & _END_HEADERS:
                self._headers_done()
        elif kind == _CONTINUATION:
            if stream != self._block_stream:
                raise ValueError("a CONTINUATION of no header block")
            self._block += payload
            if flags & _END_HEADERS:
                self._headers_done()
        elif kind == _SETTINGS:
            if not flags & _ACK:
                self._settings(payload)
        elif kind == _WINDOW_UPDATE:
            (increment,) = _U32.unpack(payload)
            increment &= 0x7FFFFFFF
            if stream == 0:
                self._send_window += increment
            elif (call := self._calls.get(stream)) is not None:
                call.window += increment
            self._flush_waiting()
        elif kind == _PING:
            if not flags & _ACK and self.transport is not None:
                self.transport.write(_frame(_PING, _ACK, 0, payload))
        elif kind == _RST_STREAM:
            if (call := self._calls.pop(stream, None)) is not None:
                (code,) = _U32.unpack(payload)
                call.fail(_error(framing.reset_code(code), f"Received RST_STREAM with error code {code}"))
        elif kind == _GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            self._accepting = False
            error = _error(Code.UNAVAILABLE, f"the server closed the connection (GOAWAY, error {code})")
            for stream_id in [s for s in self._calls if s > last & 0x7FFFFFFF]:
                self._calls.pop(stream_id).fail(error)
        elif kind == _PUSH_PROMISE:
            raise ValueError("a PUSH_PROMISE, which this client's SETTINGS refused")
        # Any other type (PRIORITY, extensions) is ignored, as HTTP/2 asks.

    def _settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == _SETTINGS_INITIAL_WINDOW_SIZE:
                for call in self._calls.values():
                    call.window += value - self._initial_window
                self._initial_window = value
            elif key == _SETTINGS_MAX_FRAME_SIZE:
                self._max_frame = value
        assert self.transport is not None
        self.transport.write(_frame(_SETTINGS, _ACK, 0))
        self._flush_waiting()

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        length = len(payload)
        if flags & _PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        self._unacked += length
        if self._unacked >= _CONNECTION_WINDOW // 2 and self.transport is not None:
            self.transport.write(_frame(_WINDOW_UPDATE, 0, 0, _U32.pack(self._unacked)))
            self._unacked = 0
        call = self._calls.get(stream)
        if call is None:
            return  # a call given up on
        call.body += payload
        try:
            framing.check_size(call.body)
        except RpcError as e:
            self.reset(call)
            call.fail(_error(e.code, e.details))
            return
        if flags & _END_STREAM:
            self._end(call)

    def _fields(self, block: bytes) -> dict[str, str]:
        """A header block decoded. Every block is, a given-up call's too: the decoder's table
        follows them all. A block that adds nothing to the table (what a server sends once its
        table holds `:status 200`, the content type and `grpc-status 0`) decodes the same until
        one that does is met, so it is remembered until then (hpack's decoding was a third of a
        call's CPU)."""
        fields = self._decoded.get(block)
        if fields is not None:
            return fields
        fields = {str(k): str(v) for k, v in self._decoder.decode(block)}
        if _changes_table(block):
            self._decoded.clear()
        else:
            if len(self._decoded) >= _REMEMBERED_BLOCKS:
                self._decoded.clear()
            self._decoded[block] = fields
        return fields

    def _headers_done(self) -> None:
        fields = self._fields(bytes(self._block))
        stream, ended = self._block_stream, self._block_end
        self._block, self._block_stream = bytearray(), 0
        call = self._calls.get(stream)
        if call is None:
            return
        if call.headers:
            call.trailers = fields
        else:
            call.headers = fields
        if ended:
            self._end(call)

    def _end(self, call: _Call) -> None:
        self._calls.pop(call.id, None)
        if not call.done.done():
            call.done.set_result(None)


class _UnaryUnary:
    """One method of a stub: `await stub.Method(request, timeout=...)`."""

    __slots__ = ("_channel", "_deserialize", "_method", "_serialize")

    def __init__(
        self,
        channel: Channel,
        method: str,
        serialize: Callable[[Any], bytes],
        deserialize: Callable[[bytes], Any],
    ) -> None:
        self._channel = channel
        self._method = method
        self._serialize = serialize
        self._deserialize = deserialize

    async def __call__(self, request: Any, *, timeout: float | None = None) -> Any:
        return self._deserialize(await self._channel.call(self._method, self._serialize(request), timeout))


class Channel:
    """What `grpc.aio.insecure_channel("unix:...")` is to the generated stubs, for unary calls."""

    def __init__(self, address: str) -> None:
        self.path = socket_path(address)
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes],
        response_deserializer: Callable[[bytes], Any],
        **_options: Any,
    ) -> _UnaryUnary:
        return _UnaryUnary(self, method, request_serializer, response_deserializer)

    async def call(self, method: str, request: bytes, timeout: float | None) -> bytes:
        """One call's answer, or grpc.aio.AioRpcError."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._connection()
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                call = conn.start(method, request, remaining)
                try:
                    await call.done
                except BaseException:
                    conn.reset(call)
                    raise
        except TimeoutError:
            raise _error(Code.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        try:
            return framing.answered(call.headers, call.trailers, bytes(call.body))
        except RpcError as e:
            raise _error(e.code, e.details) from None

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_unix_connection(_Connection, self.path)
        except OSError as e:
            reason = e.strerror or errno.errorcode.get(e.errno or 0, str(e))
            target = f"unix:{self.path}"  # grpcio's words, which the sidecars' log lines carried
            raise _error(
                Code.UNAVAILABLE,
                f"failed to connect to all addresses; last error: FAILED_PRECONDITION: {target}: "
                f"connect failed: addr: {target} error: {reason}",
            ) from None
        if self._conn is not None:
            self._conn.close()
        self._conn = conn
        return conn

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
