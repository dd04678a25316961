"""A payload made of parts, each hashed on its own: one site's update sent by several hosts.

A multi-node site's update is one payload, but no host holds all of it: node k lays out and
encodes only its own trainers' shards, as part k. The parts lie one after another in node
order, each starting on an ``ALIGN`` boundary (``lay_out``), and each node pushes the bytes of
its own part. No node can take the SHA-256 of the whole payload, so the manifest lists each
part's range and SHA-256 (``PayloadPart``), and its ``sha256`` is then the SHA-256 of the
parts' digests in order (``parts_digest``): the receiver checks every part, and the list
against that digest.

The parts tile the payload exactly (no gap, no overlap), and each tensor entry lies inside one
part. An empty ``parts`` is a payload hashed whole, as every single-host update is.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

MAX_PARTS = 4096
READ_BLOCK = 4 << 20


class PartsError(ValueError):
    """The parts a manifest lists do not describe its payload; the message says how."""


@dataclass(frozen=True)
class PayloadPart:
    """Bytes ``[offset, offset + length)`` of the payload, and their SHA-256."""

    offset: int
    length: int
    sha256: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


def parts_digest(parts: Iterable[PayloadPart]) -> bytes:
    """The manifest's ``sha256`` for a payload of ``parts``: SHA-256 of their digests."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p.sha256)
    return h.digest()


def lay_out(lengths: Sequence[int], align: int) -> list[int]:
    """Where each part starts when parts of ``lengths`` bytes follow one another, each start
    aligned up to ``align`` (the padding before a part belongs to the part before it)."""
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at = -(-(at + n) // align) * align
    return starts


def check_parts(
    parts: Sequence[PayloadPart],
    total_bytes: int,
    sha256: bytes,
    entry_spans: Iterable[tuple[str, int, int]],
) -> None:
    """Raise ``PartsError`` unless ``parts`` tile ``[0, total_bytes)`` in order, each digest is
    32 bytes, ``sha256`` is their ``parts_digest`` and no entry (label, start, end) crosses a
    part's edge."""
    if len(parts) > MAX_PARTS:
        raise PartsError(f"manifest lists {len(parts)} parts, limit {MAX_PARTS}")
    at = 0
    for i, p in enumerate(parts):
        if p.offset != at or p.length <= 0:
            raise PartsError(
                f"part {i} covers [{p.offset}, {p.end}); the parts must follow one another "
                f"from byte 0, none empty, and this one must start at byte {at}"
            )
        if len(p.sha256) != 32:
            raise PartsError(f"part {i}: its SHA-256 is {len(p.sha256)} bytes, not 32")
        at = p.end
    if at != total_bytes:
        raise PartsError(f"the parts end at byte {at}, the payload at byte {total_bytes}")
    if parts_digest(parts) != sha256:
        raise PartsError("the manifest's sha256 is not the SHA-256 of its parts' digests")
    ends = [p.end for p in parts]
    for label, start, end in entry_spans:
        part = _part_at(ends, start)
        if end > ends[part]:
            raise PartsError(
                f"tensor {label[:80]!r} [{start}, {end}) crosses the end of part {part} "
                f"(byte {ends[part]})"
            )


def _part_at(ends: list[int], offset: int) -> int:
    return min(bisect.bisect_right(ends, offset), len(ends) - 1)


def digest_of(
    read: Callable[[int, int], bytes], total_bytes: int, parts: Sequence[PayloadPart]
) -> bytes:
    """The payload's digest as its manifest states it, from ``read(offset, n)``: SHA-256 of
    the whole for a payload without parts, else the ``parts_digest`` of what each part's bytes
    hash to (so one damaged part shows as a mismatch, like one damaged byte of a whole)."""
    if not parts:
        return _sha256_of(read, 0, total_bytes).digest()
    found = [
        PayloadPart(p.offset, p.length, _sha256_of(read, p.offset, p.end).digest()) for p in parts
    ]
    return parts_digest(found)


def file_digest(path, total_bytes: int, parts: Sequence[PayloadPart]) -> bytes:
    """``digest_of`` a payload held in the file at ``path``."""
    with open(path, "rb", buffering=0) as f:

        def read(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        return digest_of(read, total_bytes, parts)


def _sha256_of(read: Callable[[int, int], bytes], start: int, end: int):
    h, at = hashlib.sha256(), start
    while at < end:
        block = read(at, min(READ_BLOCK, end - at))
        if not block:
            raise PartsError(f"the payload ends at byte {at}, before byte {end}")
        h.update(block)
        at += len(block)
    return h
