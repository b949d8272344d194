"""The C library through ctypes, loaded once for every module that calls it directly: the mount
check (statx), the node plugin's mount(2) and umount2(2), malloc_trim. `LIBC` is None where ctypes
cannot load one; each caller then does without or says so."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


LIBC = _load()


def function(name: str) -> Any | None:
    """`name` from the C library, or None where it has none (statx before glibc 2.28, malloc_trim
    outside glibc)."""
    return getattr(LIBC, name, None) if LIBC is not None else None
