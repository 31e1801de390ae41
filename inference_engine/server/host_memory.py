"""Freed memory goes back to the OS: glibc's malloc keeps it otherwise.

glibc serves an allocation of at least its mmap threshold from a map of its own, unmapped when freed, and the rest
from the heap, whose freed memory it keeps for later allocations. The threshold is dynamic by default: each map
freed raises it to that map's size (up to 32 MiB on 64-bit), so after a few MB-sized tensors are freed, tensors of
that size come from the heap and stay with the process when freed. A daemon whose sessions prefill in chunks and
archive pages then holds, between turns, memory it no longer uses (30-50 MB after a 4k-token `paged` prefill:
`scripts/research/malloc_threshold.py`).
A fixed threshold (`mallopt(M_MMAP_THRESHOLD)`, which also turns the dynamic one off) gives every tensor of at least
that size its own map. A MALLOC_MMAP_THRESHOLD_ in the environment is glibc's own setting: it is left as it is.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os

log = logging.getLogger("kakeya")

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library where it is glibc (musl, macOS: None); looked up once."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: its C library's
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt") else None


def set_mmap_threshold(kib: int) -> bool:
    """Allocations of at least `kib` KiB get maps of their own from now on, returned to the OS when freed; 0 leaves
    glibc's dynamic threshold. True if set; False where 0, where the environment sets it, or where the C library
    is not glibc (the call is then not made)."""
    libc = _glibc()
    if kib <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ or libc is None:
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, kib * 1024) != 1:
        log.warning("mallopt(M_MMAP_THRESHOLD, %d KiB) failed: freed heap memory stays with the process", kib)
        return False
    return True


def trim() -> bool:
    """malloc_trim(0): the heap's free memory back to the OS now (glibc; False elsewhere)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True
