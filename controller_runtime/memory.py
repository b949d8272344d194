"""Hands memory freed after a large decode back to the operating system.

Decoding a list page creates many short-lived objects (managedFields, the raw body). CPython frees
them, but glibc keeps the freed heap pages mapped, so a process that just listed 10,000 objects
would keep that high-water mark as RSS for its whole life. malloc_trim returns those pages.
"""

from __future__ import annotations

import gc

from . import libc

_malloc_trim = libc.function("malloc_trim")  # None outside glibc (musl, macOS): nothing to trim


def release_free_memory() -> None:
    gc.collect()
    if _malloc_trim is not None:
        _malloc_trim(0)
