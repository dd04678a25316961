"""A payload made of parts, each hashed on its own: one site's update sent by several hosts.

A multi-node site's update is one payload, but no host holds all of it: node k lays out and
encodes only its own trainers' shards, as part k. The parts lie one after another in node
order, each starting on an ``ALIGN`` boundary (``lay_out``), and each node pushes the bytes of
its own part. No node can take the digest of the whole payload, so the manifest lists each
part's range and digest (``PayloadPart``), and its ``digest`` is then the digest of the
parts' digests in order (``parts_digest``): the receiver checks every part, and the list
against that digest. Digests are ``wire.digest``'s.

The parts tile the payload exactly (no gap, no overlap), and each tensor entry lies inside one
part. An empty ``parts`` is a payload hashed whole, as every single-host update is.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from wire.digest import DIGEST_BYTES, Hasher

MAX_PARTS = 4096
READ_BLOCK = 4 << 20


class PartsError(ValueError):
    """The parts a manifest lists do not describe its payload; the message says how."""


@dataclass(frozen=True)
class PayloadPart:
    """Bytes ``[offset, offset + length)`` of the payload, and their digest."""

    offset: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


def parts_digest(parts: Iterable[PayloadPart]) -> bytes:
    """The manifest's ``digest`` for a payload of ``parts``: the digest of theirs."""
    h = Hasher()
    for p in parts:
        h.update(p.digest)
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
    digest: bytes,
    entry_spans: Iterable[tuple[str, int, int]],
) -> None:
    """Raise ``PartsError`` unless ``parts`` tile ``[0, total_bytes)`` in order, each digest is
    32 bytes, ``digest`` is their ``parts_digest`` and no entry (label, start, end) crosses a
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
        if len(p.digest) != DIGEST_BYTES:
            raise PartsError(f"part {i}: its digest is {len(p.digest)} bytes, not {DIGEST_BYTES}")
        at = p.end
    if at != total_bytes:
        raise PartsError(f"the parts end at byte {at}, the payload at byte {total_bytes}")
    if parts_digest(parts) != digest:
        raise PartsError("the manifest's digest is not the digest of its parts' digests")
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
    """The payload's digest as its manifest states it, from ``read(offset, n)``: of the
    whole for a payload without parts, else the ``parts_digest`` of what each part's bytes
    hash to (so one damaged part shows as a mismatch, like one damaged byte of a whole)."""
    if not parts:
        return _digest_of(read, 0, total_bytes).digest()
    found = [
        PayloadPart(p.offset, p.length, _digest_of(read, p.offset, p.end).digest()) for p in parts
    ]
    return parts_digest(found)


def file_digest(path, total_bytes: int, parts: Sequence[PayloadPart]) -> bytes:
    """``digest_of`` a payload held in the file at ``path``."""
    with open(path, "rb", buffering=0) as f:

        def read(offset: int, n: int) -> bytes:
            f.seek(offset)
            return f.read(n)

        return digest_of(read, total_bytes, parts)


def _digest_of(read: Callable[[int, int], bytes], start: int, end: int) -> Hasher:
    h, at = Hasher(), start
    while at < end:
        block = read(at, min(READ_BLOCK, end - at))
        if not block:
            raise PartsError(f"the payload ends at byte {at}, before byte {end}")
        h.update(block)
        at += len(block)
    return h
