"""The protocol-buffers wire format (https://protobuf.dev/programming-guides/encoding/), as much of
it as `messages` needs: varints, length-delimited fields, and skipping what a newer peer adds."""

from __future__ import annotations

from collections.abc import Iterator

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_FIXED = {I64: 8, I32: 4}


class DecodeError(ValueError):
    """The bytes are not a protocol-buffers message."""


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 are sent as their 64-bit two's complement
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise DecodeError("varint longer than 10 bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """Each field as (number, wire type, value): an int for varints and fixed-width fields, the
    bytes of a length-delimited one. Callers ignore the numbers they do not know, as protobuf does
    with fields a newer peer sends; a group (wire types 3 and 4, proto2 only) is refused."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise DecodeError("field number 0")
        if wire_type == VARINT:
            value, pos = _read_varint(data, pos)
            yield number, wire_type, value
        elif wire_type == LEN:
            length, pos = _read_varint(data, pos)
            if pos + length > len(data):
                raise DecodeError(f"field {number} runs past the end of the message")
            yield number, wire_type, data[pos : pos + length]
            pos += length
        elif wire_type in _FIXED:
            size = _FIXED[wire_type]
            if pos + size > len(data):
                raise DecodeError(f"field {number} runs past the end of the message")
            yield number, wire_type, int.from_bytes(data[pos : pos + size], "little")
            pos += size
        else:
            raise DecodeError(f"wire type {wire_type} of field {number} is not taken")


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def length_delimited(number: int, payload: bytes) -> bytes:
    """A message, string or bytes field, written even when empty (a message field's presence is
    its meaning: `ready: {}` is ready false)."""
    return tag(number, LEN) + varint(len(payload)) + payload


def string(number: int, value: str) -> bytes:
    """A proto3 string field: absent when empty, as protobuf writes it."""
    return length_delimited(number, value.encode()) if value else b""


def boolean(number: int, value: bool) -> bytes:
    """A proto3 bool field: absent when false."""
    return tag(number, VARINT) + b"\x01" if value else b""


def as_str(number: int, value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise DecodeError(f"field {number} is not length-delimited")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise DecodeError(f"field {number} is not valid UTF-8") from None


def as_bytes(number: int, value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise DecodeError(f"field {number} is not length-delimited")
    return value


def as_bool(number: int, value: int | bytes) -> bool:
    if isinstance(value, bytes):
        raise DecodeError(f"field {number} is not a varint")
    return value != 0
