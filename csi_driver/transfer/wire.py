"""The framing of a transferred file: pure functions, no I/O.

A file is sent as fixed regions of REGION logical bytes, from a start region to the last one:

    region   FRAME  tag "KLR1", region index (u64), number of extents (u32)
             per extent: EXTENT  offset (u64, from the start of the file), length (u64), then
                                 `length` bytes of data
             32-byte sha256 over the region's FRAME, its EXTENT headers and its data, in order
    end      FRAME  tag "KLE1", number of regions in the file (u64), 0 (u32)
             32-byte sha256 over the concatenation of every region digest of the file, 0 to n-1

All integers are big-endian. Only allocated extents travel (the sender finds them with
SEEK_DATA/SEEK_HOLE); a hole is never sent and stays a hole at the receiver. A region digest covers
its own header, so a region replayed at another index fails. The whole-file digest is defined over
region digests, not over the bytes, so a receiver that resumes at region K verifies it from the
digests it recorded for regions 0..K-1 plus the ones it receives: nothing of the first part is read
again on its side.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

REGION = 8 << 20
# The unit in which data is read off the stream and hashed, so a receiver holds at most a region
# of verified-but-unwritten data plus one chunk.
CHUNK = 1 << 20
DIGEST_SIZE = 32
REGION_TAG = b"KLR1"
END_TAG = b"KLE1"
FRAME = struct.Struct(">4sQI")
EXTENT = struct.Struct(">QQ")

# The HTTP headers that describe a source (HEAD and GET).
SIZE_HEADER = "X-Kubeloop-Size"
GENERATION_HEADER = "X-Kubeloop-Generation"
ACCESS_TYPE_HEADER = "X-Kubeloop-Access-Type"
FS_TYPE_HEADER = "X-Kubeloop-Fs-Type"
REGION_SIZE_HEADER = "X-Kubeloop-Region-Size"
# What a volume's copy must keep (a move): the pool kind whose budget it takes, and its mutable
# parameters (VolumeAttributesClass), as a JSON object. Absent: none.
POOL_KIND_HEADER = "X-Kubeloop-Pool-Kind"
MUTABLE_HEADER = "X-Kubeloop-Mutable-Parameters"
# Carries the one-line reason of a refusal, also on a HEAD response, which has no body.
ERROR_HEADER = "X-Kubeloop-Error"


class WireError(ValueError):
    """Bytes that break the format: the sender is broken or the stream is not the source's."""


@dataclass(frozen=True)
class SourceInfo:
    """A volume or snapshot file a node offers: where it is on that node and what a receiver needs.
    `generation` changes whenever the file may have changed (see server.file_generation)."""

    path: str
    size: int
    generation: str
    access_type: str
    fs_type: str
    pool_kind: str = ""
    mutable_parameters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RemoteSource:
    """A source as a receiver sees it, from the response headers."""

    size: int
    generation: str
    access_type: str
    fs_type: str
    region_size: int
    pool_kind: str = ""
    mutable_parameters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RegionStart:
    index: int
    extents: int


@dataclass(frozen=True)
class End:
    regions: int


def region_count(size: int) -> int:
    return -(-size // REGION)


def region_bounds(index: int, size: int) -> tuple[int, int]:
    """The logical [start, end) of region `index` of a file of `size` bytes (the last is short)."""
    start = index * REGION
    return start, min(start + REGION, size)


def region_frame(index: int, extents: int) -> bytes:
    return FRAME.pack(REGION_TAG, index, extents)


def end_frame(regions: int) -> bytes:
    return FRAME.pack(END_TAG, regions, 0)


def extent_header(offset: int, length: int) -> bytes:
    return EXTENT.pack(offset, length)


class RegionDigest:
    """The digest of one region, fed in stream order by sender and receiver alike."""

    def __init__(self, frame: bytes) -> None:
        self._h = hashlib.sha256(frame)

    def update(self, data: bytes) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()


def whole_digest(region_digests: Iterable[bytes]) -> bytes:
    h = hashlib.sha256()
    for d in region_digests:
        h.update(d)
    return h.digest()


def parse_frame(data: bytes, expected: int, size: int) -> RegionStart | End:
    """The frame the receiver expects next: region `expected` or, once every region of a file of
    `size` bytes has come, the end."""
    tag, number, extents = FRAME.unpack(data)
    last = region_count(size)
    if tag == END_TAG:
        if number != last or expected != last:
            raise WireError(f"end marker after region {expected} of {last} (it claims {number} regions)")
        return End(number)
    if tag != REGION_TAG:
        raise WireError(f"unknown frame tag {tag!r} where region {expected} was expected")
    if number != expected or expected >= last:
        raise WireError(f"region {number} where region {expected} of {last} was expected")
    start, end = region_bounds(number, size)
    if extents > end - start:  # each extent holds at least one byte of the region
        raise WireError(f"region {number} claims {extents} extents")
    return RegionStart(number, extents)


def parse_extent(data: bytes, after: int, end: int) -> tuple[int, int]:
    """An extent header inside the current region: it starts at or after `after` (the end of the
    previous extent, or the region's start) and ends by `end`, so extents never overlap."""
    offset, length = EXTENT.unpack(data)
    if length == 0 or offset < after or offset + length > end:
        raise WireError(f"extent ({offset}, {length}) outside [{after}, {end}) of its region")
    return offset, length


def source_headers(info: SourceInfo) -> dict[str, str]:
    return {
        SIZE_HEADER: str(info.size),
        GENERATION_HEADER: info.generation,
        ACCESS_TYPE_HEADER: info.access_type,
        FS_TYPE_HEADER: info.fs_type,
        REGION_SIZE_HEADER: str(REGION),
        POOL_KIND_HEADER: info.pool_kind,
        MUTABLE_HEADER: json.dumps(dict(info.mutable_parameters), sort_keys=True),
    }


def remote_source(headers: Mapping[str, str]) -> RemoteSource:
    """Reads the source headers of a response (`headers` keyed in lower case)."""

    def get(name: str) -> str:
        value = headers.get(name.lower())
        if value is None:
            raise WireError(f"the response has no {name} header")
        return value

    try:
        size, region_size = int(get(SIZE_HEADER)), int(get(REGION_SIZE_HEADER))
    except ValueError as e:
        raise WireError(f"a size header is not a number: {e}") from None
    if size < 0 or region_size != REGION:
        raise WireError(f"size {size} with regions of {region_size} bytes (this node speaks {REGION})")
    try:
        mutable = json.loads(headers.get(MUTABLE_HEADER.lower()) or "{}")
    except ValueError as e:
        raise WireError(f"the {MUTABLE_HEADER} header is not JSON: {e}") from None
    if not isinstance(mutable, dict) or not all(isinstance(v, str) for v in [*mutable, *mutable.values()]):
        raise WireError(f"the {MUTABLE_HEADER} header is not an object of strings")
    return RemoteSource(
        size=size,
        generation=get(GENERATION_HEADER),
        access_type=get(ACCESS_TYPE_HEADER),
        fs_type=get(FS_TYPE_HEADER),
        region_size=region_size,
        pool_kind=headers.get(POOL_KIND_HEADER.lower(), ""),
        mutable_parameters=mutable,
    )


# --- the HTTP/1.1 envelope: one request per connection, headers only ------------------------------

HEAD_LIMIT = 16 << 10  # a request or response head longer than this is refused


def render_head(first_line: str, headers: Mapping[str, str]) -> bytes:
    """A request or status line and its headers. Values come from ids and messages that may carry
    any character: a CR or LF must not split a header, and the head is Latin-1 by definition."""
    lines = [first_line, *(f"{k}: {one_line(v)}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode("latin-1", "replace")


def parse_head(block: bytes) -> tuple[str, dict[str, str]]:
    """The first line and the headers (names in lower case) of a head ending in an empty line."""
    lines = block.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise WireError(f"malformed header line {line[:80]!r}")
        headers[name.lower()] = value.strip()
    return lines[0], headers


def one_line(text: str) -> str:
    """`text` on one line of printable ASCII, for a header or a status body."""
    return "".join(
        c if " " <= c <= "~" else repr(c)[1:-1] for c in text.replace("\r\n", " ").replace("\n", " ")
    )
