"""Giving freed memory back to the system, so the coordinator's RSS tracks what it holds.

The coordinator's buffers come and go in model-sized and chunk-sized (1 MiB) pieces on many
threads, and gRPC's transports read each upload through many smaller slices. glibc keeps freed
blocks for reuse, so a process that once held a chunk per stream keeps that memory for good:
measured with 16 sites pushing a 64 MiB model two at a time, a plain gRPC server still held
about 40 MB more after the uploads than with 2 sites, half of it free blocks in its heap.

``return_freed_memory`` (once, at start) maps every block larger than a chunk on its own, so
that freeing it unmaps it, and bounds the arenas; ``trim`` (after each upload or fetch stream)
hands free pages inside the heaps back with ``malloc_trim``, at most every ``TRIM_EVERY_S``,
on the calling thread and never while another thread trims. Both are no-ops off glibc.
"""

from __future__ import annotations

import ctypes
import threading
import time

from wire.chunking import DEFAULT_CHUNK_BYTES

TRIM_EVERY_S = 0.25
_M_MMAP_THRESHOLD, _M_ARENA_MAX = -3, -8


def _libc():
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc has it; musl and others may not
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc()
_trimming = threading.Lock()
_last = [0.0]


# Blocks above this are mapped on their own and unmapped when freed. Just above one chunk frame
# (a default chunk, its 8-byte offset, the bytes object's header): a frame is then a heap block
# that the next frame reuses while a stream runs (``trim`` hands the pages back after it), not
# a mapping of new pages faulted in and unmapped for every MiB (measured here: 0.43 CPU s per
# GB for fresh 1 MiB blocks). Anything larger (a tensor, a whole payload) is still unmapped
# when freed.
MMAP_THRESHOLD = DEFAULT_CHUNK_BYTES + (64 << 10)


def return_freed_memory() -> None:
    """A fixed mmap threshold (glibc otherwise raises it after each large free, so a freed
    buffer stays in the heap) and two arenas."""
    if _LIBC is not None:
        _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        _LIBC.mallopt(_M_ARENA_MAX, 2)


def should_trim(now: float, last: float, every_s: float = TRIM_EVERY_S) -> bool:
    """Whether a trim is due (pure): the last one was at least ``every_s`` ago."""
    return now - last >= every_s


def trim(clock=time.monotonic) -> bool:
    """Hand free heap pages back to the system if a trim is due; True if this call did."""
    if _LIBC is None or not should_trim(clock(), _last[0]):
        return False
    if not _trimming.acquire(blocking=False):
        return False
    try:
        _LIBC.malloc_trim(0)
        _last[0] = clock()
    finally:
        _trimming.release()
    return True
