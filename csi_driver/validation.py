"""Pure checks on what arrives in a request: ids, paths, sizes and pagination tokens.

Nothing here touches the filesystem; these functions decide whether a value may ever reach it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from .errors import CsiError, aborted, invalid, out_of_range

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# Sizes are rounded up to whole MiB: mkfs and the kernel are happy with it and capacities stay
# readable. When limit_bytes forbids that, fall back to the filesystem block size.
SIZE_UNIT = MiB
MIN_UNIT = 4 * KiB
DEFAULT_VOLUME_SIZE = GiB

# Ids name files in the pool and records in the state directory, so they may only contain
# characters that can never form a path separator or a relative component: no `/`, no NUL,
# no leading dot (so never `.` or `..`).
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_NAME_LENGTH = 128  # bytes: the CSI spec's size limit for a name


def check_id(value: str, what: str) -> str:
    """Returns the id unchanged, or raises INVALID_ARGUMENT naming the field."""
    if not value:
        raise invalid(f"{what} is required")
    if not _ID.fullmatch(value):
        raise invalid(
            f"{what} {value[:200]!r} is not valid: it must be 1-128 characters of letters, digits, "
            "'.', '_' or '-', starting with a letter or digit"
        )
    return value


# Code points the CSI spec bans in names (C0 controls but TAB, LF and CR; DEL and the C1 controls).
_BANNED_IN_NAME = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def check_name(value: str, what: str = "name") -> str:
    """A volume or snapshot name: 1-128 bytes of UTF-8 without the code points the spec bans."""
    if not value:
        raise invalid(f"{what} is required")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_LENGTH:
        raise invalid(f"{what} is {size} bytes long; at most {MAX_NAME_LENGTH} are allowed")
    banned = _BANNED_IN_NAME.search(value)
    if banned is not None:
        raise invalid(
            f"{what} {value!r} contains the control character U+{ord(banned.group()):04X}, "
            "which the CSI spec does not allow in a name"
        )
    return value


def check_abs_path(value: str, what: str) -> str:
    """A host path from a request: absolute, normalised, no NUL, not the root directory."""
    if not value:
        raise invalid(f"{what} is required")
    if "\x00" in value:
        raise invalid(f"{what} contains a NUL character")
    if not value.startswith("/"):
        raise invalid(f"{what} {value!r} must be an absolute path")
    parts = value.split("/")
    if ".." in parts or "." in parts:
        raise invalid(f"{what} {value!r} must not contain '.' or '..' components")
    # normpath keeps a leading "//" (POSIX allows it a special meaning); Linux does not care.
    normalised = "/" + os.path.normpath(value).lstrip("/")
    if normalised == "/":
        raise invalid(f"{what} must not be the root directory")
    return normalised


def round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def round_down(value: int, unit: int) -> int:
    return value // unit * unit


def choose_size(required: int, limit: int, maximum: int, default: int = DEFAULT_VOLUME_SIZE) -> int:
    """The size of a new or expanded volume for a CSI capacity_range.

    0 for either bound means "not set". The result is at least `required`, at most `limit`, rounded
    up to SIZE_UNIT when the limit allows and to MIN_UNIT otherwise.
    """
    if required < 0 or limit < 0:
        raise invalid(f"capacity_range must not be negative (required_bytes={required}, limit_bytes={limit})")
    if limit and required > limit:
        raise out_of_range(f"required_bytes {required} is larger than limit_bytes {limit}")
    wanted = required or (min(default, limit) if limit else default)
    size = round_up(wanted, SIZE_UNIT)
    if limit and size > limit:
        size = round_up(wanted, MIN_UNIT)
        if size > limit:
            # Only when `wanted` is the limit itself (no required_bytes): the largest whole unit
            # under it, so a limit that is no multiple of 4 KiB still gets a volume.
            size = round_down(limit, MIN_UNIT)
        if size < max(required, 1):
            raise out_of_range(
                f"no size that is a multiple of {MIN_UNIT} bytes lies between required_bytes {required} "
                f"and limit_bytes {limit}"
            )
    if size > maximum:
        raise out_of_range(
            f"a volume of {format_size(size)} is larger than the maximum volume size {format_size(maximum)} "
            "of this driver (--max-volume-size)"
        )
    return size


def fits(capacity: int, required: int, limit: int) -> bool:
    """Whether an existing volume of `capacity` satisfies a capacity_range (idempotent create)."""
    return capacity >= required and (not limit or capacity <= limit)


_SIZE = re.compile(r"(?i)\s*(\d+(?:\.\d+)?)\s*([kmgtp]i?)?b?\s*")
_FACTORS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": KiB,
    "mi": MiB,
    "gi": GiB,
    "ti": TiB,
    "pi": 1 << 50,
}


def parse_size(text: str) -> int:
    """Parses `1073741824`, `512Mi`, `10Gi`, `1T` (Kubernetes quantity suffixes) into bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"invalid size {text!r} (use e.g. 512Mi, 10Gi, 1Ti or a number of bytes)")
    return int(float(match.group(1)) * _FACTORS[(match.group(2) or "").lower()])


def format_size(size: int) -> str:
    for unit, factor in (("Ti", TiB), ("Gi", GiB), ("Mi", MiB), ("Ki", KiB)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}B"


# Pagination tokens carry the creation sequence number of the last entry returned. Entries are
# listed in creation order, so a token stays valid when that entry is deleted, and entries created
# between two pages appear on a later page instead of shifting everything by one.
_TOKEN = re.compile(r"s(\d{1,19})")

T = TypeVar("T")


@dataclass(frozen=True)
class Page(Generic[T]):
    entries: list[T]
    next_token: str


def parse_token(token: str) -> int:
    if not token:
        return 0
    match = _TOKEN.fullmatch(token)
    if not match:
        raise aborted(f"starting_token {token[:100]!r} was not issued by this driver; list again without it")
    return int(match.group(1))


def paginate(items: Sequence[tuple[int, T]], starting_token: str, max_entries: int) -> Page[T]:
    """Pages over (sequence, item) pairs sorted by sequence."""
    if max_entries < 0:
        raise invalid(f"max_entries must not be negative, got {max_entries}")
    after = parse_token(starting_token)
    rest = [(seq, item) for seq, item in items if seq > after]
    if max_entries and len(rest) > max_entries:
        rest = rest[:max_entries]
        return Page([item for _, item in rest], f"s{rest[-1][0]}")
    return Page([item for _, item in rest], "")


__all__ = [
    "DEFAULT_VOLUME_SIZE",
    "CsiError",
    "GiB",
    "MiB",
    "Page",
    "TiB",
    "check_abs_path",
    "check_id",
    "check_name",
    "choose_size",
    "fits",
    "format_size",
    "paginate",
    "parse_size",
    "parse_token",
]
