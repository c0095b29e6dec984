"""glibc's heap, told to give freed memory back: what keeps a long run's resident memory close to
what it holds. No effect off glibc. Imports nothing heavy (the CLI calls it first thing)."""

from __future__ import annotations

import ctypes

_LIBC: ctypes.CDLL | bool | None = None


def _libc() -> ctypes.CDLL | None:
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:  # not glibc
            _LIBC = False
    return _LIBC or None


def return_to_os() -> None:
    """``malloc_trim``: free heap pages back to the OS."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 2**20
"""Allocations of this size or more get a memory mapping of their own, returned to the OS when
freed. glibc's default threshold starts at 128 KiB and rises (up to 32 MiB) each time a mapped
block is freed, after which tensors of up to 32 MiB come from its heap, whose freed memory mostly
stays with the process and grows in holes. Fixed at 1 MiB (which also stops the rising), the same
`compress run` (Qwen2.5-1.5B cut to 4 blocks, RTN and a verified GGUF) peaked at 1,287 / 1,515 /
1,835 MiB in evaluation / writing model/ / the export, against 2,095 / 2,091 / 2,775 MiB
(MALLOC_MMAP_THRESHOLD_=1048576 against nothing, the same code; docs/models-and-data.md)."""


def release_freed_memory() -> None:
    """Set glibc's mmap threshold (``MMAP_THRESHOLD_BYTES``) for this process; the CLI does it first
    thing. No effect off glibc."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
