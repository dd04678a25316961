"""Cutting a payload into chunks, and the sizes and errors of chunks on the wire.

A receiver accepts only the chunk that starts exactly where its stream's bytes end, so a
reordered, duplicated, overlapping or missing chunk is refused with a message that says which
(the coordinator's ``intake.upload_bytes.chunk_refusal``, a site's ``transfer.plan
.chunk_problem``), and the digest over the whole payload is checked before anyone may read it.
"""

from __future__ import annotations

from collections.abc import Iterator

MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
# 1 MiB: gRPC holds a received message whole, and with the window full that is a chunk or two
# per upload at the coordinator; halving the chunk took 16 sites' peak from 3.2x to 3.0x the
# model (bench.scale) for about 1% more CPU per byte.
DEFAULT_CHUNK_BYTES = 1 << 20


class ChunkError(ValueError):
    """A chunk or a finished payload that breaks the stream's rules."""


def iter_chunks(
    payload: bytes | bytearray | memoryview,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    start: int = 0,
    stop: int | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """Yield ``(offset, bytes)`` pieces of ``payload[start:stop]`` (``stop`` None: the end)."""
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(
            f"chunk size {chunk_bytes} outside {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} bytes"
        )
    view = memoryview(payload).cast("B")
    stop = len(view) if stop is None else stop
    if not 0 <= start <= stop <= len(view):
        raise ValueError(
            f"resume offset {start} or end {stop} outside the {len(view)}-byte payload"
        )
    for offset in range(start, stop, chunk_bytes):
        yield offset, view[offset : min(offset + chunk_bytes, stop)]


class BufferSink:
    """A sink writing into a preallocated ``bytearray``: in order (``write``), or each piece
    at its offset (``write_at``: the pieces of a transfer over parallel streams)."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self._pos = 0

    def write(self, data: bytes | memoryview) -> int:
        n = len(data)
        self.buffer[self._pos : self._pos + n] = data
        self._pos += n
        return n

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        # Through a memoryview: a slice of the wrong length is refused, never resizes.
        memoryview(self.buffer)[offset : offset + len(data)] = data

    def payload_view(self) -> memoryview:
        return memoryview(self.buffer)


def tensor_pieces(entries, start: int, data) -> Iterator[tuple[object, int, memoryview]]:
    """Where a chunk's bytes go: ``(entry, offset inside the entry, bytes)`` for each tensor
    entry of a payload (``entries`` sorted by offset) that the chunk ``data`` at payload
    offset ``start`` overlaps. Padding between entries goes nowhere."""
    view = memoryview(data).cast("B")
    end = start + len(view)
    for e in entries:
        lo, hi = max(start, e.offset), min(end, e.offset + e.nbytes)
        if lo < hi:
            yield e, lo - e.offset, view[lo - start : hi - start]
