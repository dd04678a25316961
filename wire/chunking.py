"""Cutting a payload into chunks and putting it back together, strictly in order.

A receiver accepts only the chunk that starts exactly where the verified bytes end, so a
reordered, duplicated, overlapping or missing chunk is refused with a message that says which,
and the SHA-256 over the whole payload is checked before anyone may read it. Resuming after a
broken stream means sending again from ``Reassembler.received``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Protocol

MIN_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 4 << 20
# 1 MiB: gRPC holds a received message whole, and with the window full that is a chunk or two
# per upload at the coordinator; halving the chunk took 16 sites' peak from 3.2x to 3.0x the
# model (bench.scale) for about 1% more CPU per byte.
DEFAULT_CHUNK_BYTES = 1 << 20


class ChunkError(ValueError):
    """A chunk or a finished payload that breaks the stream's rules."""


class Sink(Protocol):
    def write(self, data: bytes | memoryview, /) -> object: ...


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


class Reassembler:
    """Checks and writes one payload's chunks into ``sink`` in order.

    Parameters
    ----------
    total_bytes, sha256
        What the sender declared for the whole payload.
    sink
        Where verified-in-order bytes go (a file, a ``bytearray`` wrapper, ...).
    received, hasher
        To continue a payload already partly received: the byte count and the SHA-256 state
        over those bytes.
    """

    def __init__(
        self,
        total_bytes: int,
        sha256: bytes,
        sink: Sink,
        received: int = 0,
        hasher: hashlib._Hash | None = None,
    ) -> None:
        if not 0 <= received <= total_bytes:
            raise ChunkError(f"resume offset {received} outside the {total_bytes}-byte payload")
        if received and hasher is None:
            raise ChunkError("resuming at a non-zero offset needs the hasher over those bytes")
        self.total_bytes = total_bytes
        self.expected_sha256 = sha256
        self.sink = sink
        self.received = received
        self._hasher = hasher if hasher is not None else hashlib.sha256()

    def add(self, offset: int, data: bytes | memoryview) -> None:
        n = len(data)
        if n == 0:
            raise ChunkError(f"empty chunk at offset {offset}")
        if n > MAX_CHUNK_BYTES:
            raise ChunkError(f"chunk of {n} bytes exceeds the {MAX_CHUNK_BYTES}-byte limit")
        if offset < self.received:
            raise ChunkError(
                f"duplicated chunk: offset {offset} was already received "
                f"(next expected offset {self.received})"
            )
        if offset > self.received:
            raise ChunkError(
                f"out-of-order chunk: offset {offset}, next expected offset {self.received} "
                f"(a chunk is missing or was reordered)"
            )
        if offset + n > self.total_bytes:
            raise ChunkError(
                f"chunk at offset {offset} of {n} bytes runs past the declared "
                f"{self.total_bytes}-byte payload"
            )
        # Written first: the hash then only ever covers bytes the sink accepted.
        self.sink.write(data)
        self._hasher.update(data)
        self.received += n

    @property
    def complete(self) -> bool:
        return self.received == self.total_bytes

    def finish(self) -> None:
        """Raise unless every byte arrived and the SHA-256 matches."""
        if self.received != self.total_bytes:
            raise ChunkError(
                f"truncated payload: {self.received} of {self.total_bytes} bytes received"
            )
        if self._hasher.digest() != self.expected_sha256:
            raise ChunkError("payload SHA-256 mismatch: the data was corrupted in flight")


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
