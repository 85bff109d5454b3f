"""Giving the process's free heap memory back to the system once the engine is idle.

Each step allocates and frees host tensors whose sizes follow the batch (logits, activations,
sampling buffers). glibc's malloc raises its mmap threshold after freeing a large mapped block, so
later blocks of that size come from the heap, and a heap with live blocks scattered through it
keeps its freed pages: the resident set then wanders up and down with the batch mix, by tens of
megabytes on the CPU, without being held by anything (measured by benchmarks/soak.py; Python's own
objects stay flat). `malloc_trim(0)` returns those free pages; the engine core calls it when it
has had nothing to do for a moment, so it costs nothing under load and an idle server shows the
memory it actually holds.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None on another C library or platform."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


@functools.cache
def _madvise():
    """The C library's madvise and the page size, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn, os.sysconf("SC_PAGE_SIZE")


_MADV_DONTNEED = 4


def page_size() -> int:
    """The system's memory page size (4 KiB where it cannot be read)."""
    found = _madvise()
    return found[1] if found is not None else 4096


def release_pages(address: int, length: int) -> int:
    """Give the whole pages inside [address, address + length) of an anonymous mapping back to
    the system (MADV_DONTNEED: read again, they are zero); returns the bytes released (0 where
    the platform cannot)."""
    found = _madvise()
    if found is None:
        return 0
    madvise, page = found
    start = -(-address // page) * page
    end = (address + length) // page * page
    if end <= start:
        return 0
    if madvise(start, end - start, _MADV_DONTNEED) != 0:
        return 0
    return end - start


def trim_free_heap() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
